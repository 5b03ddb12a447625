"""Shared m x m token grouping of 2x2-style mergers: pure tensor code, no parameters.

Two layouts exist for the m²·H vector of one block (blocks are row-major in both):

* ``channel``-major: element ``c·m² + r·m + s`` is channel c of the patch at row r, column s of
  the block — the order ``F.unfold`` produces (Pixtral-Large / HF ``Mistral3PatchMerger``);
* ``patch``-major: ``[patch (0,0) ‖ patch (0,1) ‖ … ‖ patch (m-1,m-1)]``, each H wide (Qwen-VL,
  Kimi, InternVL ``pixel_shuffle`` version 2).

The two hold the same numbers in a different order, so a merger weight trained for one layout
is silently wrong under the other; the layout is therefore always named explicitly.
"""

from __future__ import annotations

import torch

ORDERS = ("channel", "patch")


def merged_grid(h_patches: int, w_patches: int, merge: int, *, drop_remainder: bool) -> tuple[int, int]:
    """(blocks per column, blocks per row). With ``drop_remainder`` a trailing partial row / column
    is dropped (``F.unfold`` semantics); otherwise the grid must tile exactly."""
    if h_patches < merge or w_patches < merge:
        raise ValueError(f"a {h_patches}x{w_patches} patch grid has no complete {merge}x{merge} block")
    if not drop_remainder and (h_patches % merge or w_patches % merge):
        raise ValueError(f"a {h_patches}x{w_patches} patch grid does not tile into {merge}x{merge} blocks")
    return h_patches // merge, w_patches // merge


def fold_blocks(x: torch.Tensor, h_patches: int, w_patches: int, merge: int, order: str, *,
                drop_remainder: bool = False) -> torch.Tensor:
    """(..., h·w, H) raster tokens -> (..., hb·wb, m²·H) block vectors in ``order``."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if x.shape[-2] != h_patches * w_patches:
        raise ValueError(f"{x.shape[-2]} tokens do not form a {h_patches}x{w_patches} grid")
    hb, wb = merged_grid(h_patches, w_patches, merge, drop_remainder=drop_remainder)
    hidden, lead = x.shape[-1], x.shape[:-2]
    grid = x.reshape(-1, h_patches, w_patches, hidden)[:, : hb * merge, : wb * merge]
    blocks = grid.reshape(-1, hb, merge, wb, merge, hidden)  # n, hb, r, wb, s, c
    if order == "channel":
        blocks = blocks.permute(0, 1, 3, 5, 2, 4)  # n, hb, wb, c, r, s
    else:
        blocks = blocks.permute(0, 1, 3, 2, 4, 5)  # n, hb, wb, r, s, c
    return blocks.reshape(*lead, hb * wb, merge * merge * hidden)
