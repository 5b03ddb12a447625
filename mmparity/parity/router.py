"""Router agreement: whether an MoE layer sends every token to the experts HF sends it to.

Comparing routing weights as one tensor cannot tell a tie from a bug: two experts whose scores
are equal to within rounding may be picked in either order, and one such token moves a whole row
of weights. So a router pair is judged token by token. Both sides hand over ``[tokens, experts,
2]``: the routing weights (zero where an expert was not chosen) and the scores the choice was made
on (HF's sigmoid scores plus the correction bias; a side that does not expose them gives zeros).
For each token whose chosen set differs from HF's, the gap is the smallest difference of HF's
choice scores between an expert only HF chose and one only the other side chose: within
:func:`tie_tolerance` it is a tie (rounding decided), otherwise a disagreement, which fails and
names the layer. Tokens with the same set then compare their weights as any module output does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmparity.models.spec import routing_tensor  # noqa: F401  (what router pairs' extractors return)
# Paired modules named so are routers, compared by :func:`agreement`, not as one tensor. The name
# rule lives with the report's schema, which a reader of a saved report uses without torch.
from mmparity.parity.report import ROUTER_SUFFIX, is_router, routes_alike  # noqa: F401

# Choice scores are sigmoid outputs plus a bias, of order one; a tie is a difference the model's
# arithmetic could have made (a few units in the last place of its dtype).
_TIE_ULPS = 8


def tie_tolerance(dtype: torch.dtype) -> float:
    return _TIE_ULPS * torch.finfo(dtype).eps


def tie_scale(low_precision: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """What counts as a tie at a layer deep in a low-precision model. A router's scores there carry
    the rounding of every layer before it, not only of its own arithmetic: HF's own model in that
    dtype moves them by this much against its float32 run. Twice the largest such move (the
    noise-floor policy of every other bound), and never less than :func:`tie_tolerance`."""
    if low_precision.shape != expected.shape:
        return tie_tolerance(dtype)
    moved = (low_precision[..., 1].float() - expected[..., 1].float()).abs()
    return max(tie_tolerance(dtype), 2 * float(moved.max()) if moved.numel() else 0.0)


@dataclass
class RouterAgreement:
    tokens: int
    agreeing: int
    ties: int
    worst_gap: float  # the largest choice-score gap among disagreeing tokens (0 if none)
    tie_tolerance: float
    # Disagreements the dtype's own rounding accounts for: in a low precision, twice those of
    # HF's model in that precision against its float32 run (the noise-floor policy of every
    # other bound); none in float32.
    allowed: int = 0

    @property
    def fraction(self) -> float:
        return self.agreeing / self.tokens if self.tokens else 1.0

    @property
    def disagreements(self) -> int:
        return self.tokens - self.agreeing - self.ties

    @property
    def passed(self) -> bool:
        return self.disagreements <= self.allowed

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "same_experts": self.agreeing, "fraction": self.fraction,
                "ties": self.ties, "disagreements": self.disagreements, "allowed": self.allowed,
                "worst_gap": self.worst_gap, "tie_tolerance": self.tie_tolerance}


def agreement(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
              low_precision: torch.Tensor | None = None) -> tuple[RouterAgreement, torch.Tensor]:
    """The agreement of ``actual``'s routing with ``expected``'s (HF's), and the mask of tokens
    that chose the same experts. ``low_precision``: HF's own model in ``dtype`` (when that is not
    the reference's), whose score error at this layer widens what counts as a tie
    (:func:`tie_scale`)."""
    if actual.shape != expected.shape or actual.dim() != 3 or actual.shape[-1] != 2:
        raise ValueError(f"router outputs of shapes {tuple(actual.shape)} and {tuple(expected.shape)}: "
                         "expected equal [tokens, experts, 2]")
    chosen, reference = actual[..., 0] != 0, expected[..., 0] != 0
    same = (chosen == reference).all(dim=-1)
    scores = expected[..., 1]
    tolerance = tie_tolerance(dtype) if low_precision is None else tie_scale(low_precision, expected, dtype)
    ties, worst = 0, 0.0
    for token in (~same).nonzero().flatten().tolist():
        only_reference = scores[token][reference[token] & ~chosen[token]]
        only_actual = scores[token][chosen[token] & ~reference[token]]
        if not len(only_reference) or not len(only_actual):  # a different number of experts
            worst = float("inf")
            continue
        gap = float((only_reference[:, None] - only_actual[None, :]).abs().min())
        worst = max(worst, gap)
        ties += gap <= tolerance
    return RouterAgreement(int(same.numel()), int(same.sum()), ties, worst, tolerance), same

