"""Report dataclasses and their JSON form. Rendering for people lives in the CLI."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

# Where a report's object held a number that JSON cannot (NaN, ±Infinity): the member is null and
# this member of the same object names it and what it was, e.g. {"rel_l2": null, "non_finite":
# {"rel_l2": "NaN"}}. A list element is named "key[i]".
NON_FINITE = "non_finite"


# Paired modules of this name are routers (judged by :mod:`mmparity.parity.router`): their rows
# carry a ``router`` verdict among their metrics.
ROUTER_SUFFIX = ".mlp.router"


def is_router(name: str) -> bool:
    return name.endswith(ROUTER_SUFFIX)


def routes_alike(row: dict) -> bool:
    """Whether a router pair's row (the harness's) sends every token to HF's experts, ties and the
    dtype's noise floor aside: what a router check gates on."""
    verdict = (row.get("metrics") or {}).get("router")
    if "error" in row or not isinstance(verdict, dict):
        return False
    return verdict.get("disagreements", 0) <= verdict.get("allowed", 0)


def _spelled(value: float) -> str:
    return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"


def _non_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _strict(value):
    """``value`` with every NaN / infinite float made null and named in its object's
    ``non_finite`` member (see :data:`NON_FINITE`)."""
    if isinstance(value, dict):
        out, named = {}, {}
        for key, item in value.items():
            if _non_finite(item):
                out[key], named[str(key)] = None, _spelled(item)
            elif isinstance(item, (list, tuple)):
                out[key] = [None if _non_finite(x) else _strict(x) for x in item]
                named.update({f"{key}[{i}]": _spelled(x) for i, x in enumerate(item) if _non_finite(x)})
            else:
                out[key] = _strict(item)
        if named:
            out[NON_FINITE] = named
        return out
    if isinstance(value, (list, tuple)):
        return [None if _non_finite(x) else _strict(x) for x in value]
    return value


def strict_json(data, indent: int = 2) -> str:
    """JSON text every parser reads (no bare NaN or Infinity): non-finite numbers as null, named
    in their object's ``non_finite`` member with what they were."""
    return json.dumps(_strict(data), indent=indent, allow_nan=False)


@dataclass
class Divergence:
    module: str
    metrics: dict
    tolerance: dict

    def as_dict(self) -> dict:
        return {"module": self.module, "metrics": self.metrics, "tolerance": self.tolerance}


@dataclass
class Result:
    family: str
    check: str
    passed: bool
    metrics: dict
    tolerance: dict
    first_divergence: Optional[Divergence] = None
    description: str = ""
    modules: list = field(default_factory=list)  # per paired module: {"module", "metrics", "passed"}
    impl: str = "native"  # whose model produced it: "native" (mmparity's) or "megatron" (Megatron's own)
    # Wall seconds of this result's share of its case in the reporting process (the reference's
    # runs and the comparison; a case's outputs share it equally), None where not measured. Not in
    # as_dict(): a result is the same data run after run, its time is not (the report lists times
    # beside the results).
    seconds: Optional[float] = None

    def as_dict(self) -> dict:
        return {
            "family": self.family,
            "check": self.check,
            "passed": self.passed,
            "metrics": self.metrics,
            "tolerance": self.tolerance,
            "first_divergence": self.first_divergence.as_dict() if self.first_divergence else None,
            "description": self.description,
            "modules": self.modules,
            "impl": self.impl,
        }


@dataclass
class Report:
    device: str
    dtype: str
    seed: int
    attention_backend: str
    results: list = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    tp: int = 1
    pp: int = 1
    ep: int = 1
    impl: str = "native"
    # With Megatron's class under test: its version, which TE modules ran, the class.
    megatron: Optional[dict] = None

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def failures(self) -> list:
        return [r for r in self.results if not r.passed]

    def as_dict(self) -> dict:
        return {
            "versions": self.versions,
            "device": self.device,
            "dtype": self.dtype,
            "seed": self.seed,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "attention_backend": self.attention_backend,
            "passed": self.passed,
            "impl": self.impl,
            **({"megatron": self.megatron} if self.megatron is not None else {}),
            "results": [r.as_dict() for r in self.results],
            "result_seconds": [r.seconds for r in self.results],
        }

    def to_json(self, indent: int = 2) -> str:
        return strict_json(self.as_dict(), indent)


def versions() -> dict:
    from importlib import metadata

    import mmparity

    out = {"mmparity": mmparity.__version__}
    for dist, key in (("torch", "torch"), ("transformers", "transformers"),
                      ("megatron-core", "megatron-core")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out
