"""Error metrics and the one tolerance policy.

Policy (the only place tolerances live):

* float32: the native output must be within ``rel_l2 <= 1e-5`` of the float32 reference.
* bfloat16 / float16: "is this diff normal?" is answered against the reference's own rounding.
  Both the native model and the HF reference run in the low-precision dtype on the same inputs;
  each is measured against the float32 reference; the native error may be at most
  ``LOW_PRECISION_FACTOR`` times the reference's. The bound adapts to depth, width and dtype
  instead of a fixed "max diff < 50".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

FP32_REL_L2 = 1e-5
LOW_PRECISION_FACTOR = 2.0
# Below this the reference's own low-precision error is treated as this value, so an (unlikely)
# exact reference does not demand bit-exactness from the native side.
LOW_PRECISION_FLOOR = 1e-6


@dataclass
class Metrics:
    max_abs: float
    mean_abs: float
    rel_l2: float
    cosine: float

    def as_dict(self) -> dict:
        return asdict(self)


def compare(actual: torch.Tensor, expected: torch.Tensor) -> Metrics:
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a = actual.detach().double().flatten()
    e = expected.detach().double().flatten()
    diff = a - e
    denom = e.norm()
    rel = (diff.norm() / denom).item() if denom > 0 else diff.norm().item()
    cos = torch.nn.functional.cosine_similarity(a, e, dim=0, eps=1e-30).item() if a.numel() else 1.0
    finite = torch.isfinite(a).all().item()
    return Metrics(max_abs=diff.abs().max().item() if a.numel() else 0.0,
                   mean_abs=diff.abs().mean().item() if a.numel() else 0.0,
                   rel_l2=rel if finite else float("inf"), cosine=cos if finite else float("nan"))


@dataclass
class Tolerance:
    """``rel_l2`` bound; ``basis`` says where it came from, for the report."""

    rel_l2: float
    basis: str

    def accepts(self, metrics: Metrics) -> bool:
        return metrics.rel_l2 <= self.rel_l2

    def as_dict(self) -> dict:
        return {"rel_l2": self.rel_l2, "basis": self.basis}


def fp32_tolerance() -> Tolerance:
    return Tolerance(FP32_REL_L2, "float32: rel_l2 <= 1e-5")


def low_precision_tolerance(reference_error: float, dtype_name: str) -> Tolerance:
    bound = LOW_PRECISION_FACTOR * max(reference_error, LOW_PRECISION_FLOOR)
    return Tolerance(bound, f"{dtype_name}: {LOW_PRECISION_FACTOR:g} x HF {dtype_name} error "
                            f"({reference_error:.3g}) vs float32 reference")


def tolerance_for(dtype: torch.dtype, reference_error: float | None = None) -> Tolerance:
    if dtype == torch.float32:
        return fp32_tolerance()
    if reference_error is None:
        raise ValueError("low-precision tolerance needs the reference's own error")
    return low_precision_tolerance(reference_error, str(dtype).removeprefix("torch."))
