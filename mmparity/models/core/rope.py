"""2D rotary position embeddings in mcore's ``rotary_pos_emb`` format: raw angles ``(N, 1, 1, head_dim)``.

mcore turns the angles into cos/sin itself. With ``rotary_interleaved=True`` it rotates adjacent
pairs (2t, 2t+1), so interleaved families must repeat every angle twice in place.
"""

from __future__ import annotations

import torch


def _grid_ids(h_patches: int, w_patches: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.arange(h_patches, device=device).repeat_interleave(w_patches)
    cols = torch.arange(w_patches, device=device).repeat(h_patches)
    return rows, cols


class Pixtral2DRotaryEmbedding(torch.nn.Module):
    """Mistral's axial 2D RoPE: pair t of a head rotates by row·f[2t] (first half) or col·f[2t+1].

    For patch (i, j) the hd/2 angles are ``[i·f[0::2] ‖ j·f[1::2]]`` with f[k] = θ^(-2k/hd),
    each repeated twice in place for mcore's interleaved rotation. HF ``PixtralVisionModel`` uses
    the same angles in rotate-half layout on per-head-permuted q/k weights (see the converter).

    Deviation from Megatron-LM ``megatron/core/models/vision/vit_model.py``: ``max_patches_per_side`` is validated, not used to cap a table — the
    angles are computed from the ids directly, so a larger grid is refused with a clear message
    instead of silently indexing past the table.
    """

    def __init__(self, head_dim: int, max_patches_per_side: int, rope_theta: float = 10000.0):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2D RoPE needs a head_dim divisible by 4, got {head_dim}")
        self.head_dim = head_dim
        self.max_patches_per_side = max_patches_per_side
        self.rope_theta = rope_theta

    def base_freqs(self, device) -> torch.Tensor:
        # Recomputed in fp32 on every call rather than stored as a buffer: ``model.to(bfloat16)``
        # would round a float buffer and shift every angle.
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim
        return (1.0 / self.rope_theta ** exponents).float()

    def angles(self, row_ids: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
        """(N,) ids -> (N, head_dim/2) angles, not yet interleaved."""
        freqs = self.base_freqs(row_ids.device)
        rows = row_ids.to(torch.float32)[:, None] * freqs[0::2]
        cols = col_ids.to(torch.float32)[:, None] * freqs[1::2]
        return torch.cat([rows, cols], dim=-1)

    def forward(self, h_patches: int, w_patches: int, device: torch.device) -> torch.Tensor:
        if max(h_patches, w_patches) > self.max_patches_per_side:
            raise ValueError(
                f"image grid {h_patches}x{w_patches} patches exceeds max_patches_per_side="
                f"{self.max_patches_per_side} (image_size // patch_size of the config)")
        rows, cols = _grid_ids(h_patches, w_patches, device)
        angles = self.angles(rows, cols)
        return angles.repeat_interleave(2, dim=-1)[:, None, None, :]
