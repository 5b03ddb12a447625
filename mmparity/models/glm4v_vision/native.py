"""Native GLM-4.5V vision tower on an mcore ``TransformerBlock``: Qwen3.5's ``QwenVLViTModel``
(Conv3d patches over (T, P, P) tubelets, block-first token order, 2D RoPE in rotate-half layout;
imported, not restated) with what GLM does differently.

Reference: transformers 5.24 ``Glm4vMoeVisionModel``. Differences from the parent:

* an RMSNorm right after the patch embedding (``post_conv_layernorm``), before the position
  embedding is added;
* the position embedding: a learned (g², H) table (HF's ``embeddings.position_embedding``) read
  at each patch by ``grid_sample`` — bicubic, ``align_corners=False``, border padding — at the
  normalised coordinate ((j + 0.5) / w)·2 − 1 of patch column j of a w-wide grid (rows likewise).
  The same call on the same fp32 table and coordinates as transformers', over all images' patches
  at once, so the resampling is the same to the bit in fp32; the result is cast to the weights'
  dtype and added;
* RMSNorm blocks with a gated MLP without biases whose width is ``out_hidden_size``, q/k/v biases
  as ``attention_bias`` says, no output-projection bias;
* a final RMSNorm (``decoder.final_layernorm``, HF's ``post_layernorm``);
* the merger (:class:`GlmPatchMerger`): each m×m block (consecutive in block-first order) through
  a stride-m convolution to ``out_hidden_size`` (``merger.downsample``, HF's ``downsample``), then
  a linear without bias, LayerNorm, exact GELU, and a gated MLP (``linear_fc1`` = [gate; up],
  ``linear_fc2``) of width ``intermediate_size``; plain modules whole on every TP rank, as
  Megatron's Qwen merger keeps its linears.

Megatron-LM main has no GLM tower; the layout is its ``QwenVLViTModel``'s (``patch_embed``,
``pos_embed``, ``decoder.layers.N``, ``merger``) with the pieces it has no place for named after
HF's modules. Images only: a clip's frames are taken by the whole model as transformers takes them
(one-frame grids), not here.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import first_int, rope_theta
from mmparity.models.core.layers import (
    activation_from_hf, tolerate_missing_extra_state, vision_layer_spec, vision_transformer_config)
from mmparity.models.core.vit import ImageSizes
from mmparity.models.glm4v_vision.config import transformer_fields
from mmparity.models.qwen3_5.native import QwenVLViTModel, block_first, block_first_ids

Grid = Tuple[int, int]

# transformers builds the merger's LayerNorm with torch's default epsilon.
MERGER_NORM_EPS = 1e-5


class GlmPositionEmbedding(torch.nn.Module):
    """The learned (g·g, H) table (``pos_embed.weight``) resampled bicubically to each grid."""

    def __init__(self, num_positions: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        side = int(round(num_positions ** 0.5))
        if side * side != num_positions:
            raise ValueError(f"the position table has {num_positions} rows, not a square number")
        self.side = side
        self.weight = torch.nn.Parameter(torch.empty(num_positions, hidden_size, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, heights: torch.Tensor,
                widths: torch.Tensor) -> torch.Tensor:
        """``tokens`` (…, N, H) plus the embeddings at patch (row, col) of grids (height, width),
        one entry per patch, cast to the weights' dtype and then to the tokens' (HF's
        ``embeddings`` module, whose output parity pairs)."""
        g, hidden = self.side, self.weight.shape[1]
        table = self.weight.view(g, g, hidden).permute(2, 0, 1).unsqueeze(0).float()
        # The expressions in transformers' order, so that the coordinates round as its do.
        x = ((cols + 0.5) / widths.float()) * 2 - 1
        y = ((rows + 0.5) / heights.float()) * 2 - 1
        grid = torch.stack((x, y), dim=-1).unsqueeze(0).unsqueeze(2)
        out = F.grid_sample(table, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return tokens + out.squeeze(0).squeeze(-1).permute(1, 0).to(self.weight.dtype).to(tokens.dtype)


class GlmPatchMerger(MegatronModule):
    """HF's ``downsample`` + ``Glm4vMoeVisionPatchMerger``: (B, N, H) block-first tokens -> (B, N/m²,
    out). The convolution sees each block as an m×m image of H channels, as transformers reshapes
    it."""

    def __init__(self, config: TransformerConfig, hidden_size: int, spatial_merge_size: int,
                 out_hidden_size: int, intermediate_size: int, activation):
        super().__init__(config=config)
        dtype, m = config.params_dtype, spatial_merge_size
        self.hidden_size, self.spatial_merge_size, self.out_hidden_size = hidden_size, m, out_hidden_size
        self.activation = activation
        self.downsample = torch.nn.Conv2d(hidden_size, out_hidden_size, kernel_size=m, stride=m, dtype=dtype)
        self.linear_proj = torch.nn.Linear(out_hidden_size, out_hidden_size, bias=False, dtype=dtype)
        self.norm = torch.nn.LayerNorm(out_hidden_size, eps=MERGER_NORM_EPS, dtype=dtype)
        self.linear_fc1 = torch.nn.Linear(out_hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.linear_fc2 = torch.nn.Linear(intermediate_size, out_hidden_size, bias=False, dtype=dtype)

    def downsampled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, H) -> (B·N/m², out): HF's ``last_hidden_state``."""
        m = self.spatial_merge_size
        blocks = x.reshape(-1, m, m, self.hidden_size).permute(0, 3, 1, 2)
        return self.downsample(blocks).view(-1, self.out_hidden_size)

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.norm(self.linear_proj(tokens)))  # erf GELU, as HF's nn.GELU()
        gate, up = self.linear_fc1(hidden).chunk(2, dim=-1)
        return self.linear_fc2(self.activation(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.downsampled(x))


class Glm4vViTModel(QwenVLViTModel):
    """Native GLM-4.5V vision encoder: pixels ``(B, C, H, W)``, or packed processor rows
    ``(1, ΣN, D)`` / ``(ΣN, D)`` with ``imgs_sizes``; each image attends only to itself.

    :meth:`features` gives HF's ``last_hidden_state`` (the downsampled tokens) and
    ``pooler_output`` (the merger's) on the last pipeline stage."""

    def __init__(self, transformer_config: TransformerConfig, transformer_layer_spec, *, num_positions: int,
                 intermediate_size: int, norm_eps: float, activation, **kwargs):
        # The parent builds Qwen's position table, block and merger; GLM's replace them below (a
        # build's cost, at build time only, for the parent's patch embedding, RoPE and input paths).
        super().__init__(transformer_config, transformer_layer_spec, num_pos_per_side=1, **kwargs)
        cfg = transformer_config
        self.pos_embed = self.post_conv_layernorm = None
        if self.pre_process:
            self.post_conv_layernorm = torch.nn.RMSNorm(cfg.hidden_size, eps=norm_eps, dtype=cfg.params_dtype)
            self.pos_embed = GlmPositionEmbedding(num_positions, cfg.hidden_size, cfg.params_dtype)
        # The parent's block has no final norm: GLM's is the block's own, on the last stage.
        self.decoder = TransformerBlock(config=cfg, spec=transformer_layer_spec, post_layer_norm=True,
                                        pre_process=self.pre_process, post_process=self.post_process)
        self.merger = (GlmPatchMerger(cfg, cfg.hidden_size, self.spatial_merge_size,
                                      kwargs.get("out_hidden_size", cfg.hidden_size), intermediate_size, activation)
                       if self.post_process else None)
        tolerate_missing_extra_state(self)

    def embed(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes] = None):
        """-> (tokens (B, N, H) block-first, normed, with the position embedding; None off the first
        stage), rotary (N, 1, 1, d), grids, seqlens or None)."""
        m = self.spatial_merge_size
        pixel_values, grids, seqlens = self.patch_grids(pixel_values, imgs_sizes)
        device = pixel_values.device
        ids = [block_first_ids(h, w, m, device) for h, w in grids]
        rope = torch.cat([self.rotary_pos_emb(rows, cols) for rows, cols in ids])
        tokens = None
        if self.pre_process:
            tokens = self.patch_embed(pixel_values)
            if seqlens is None:
                tokens = block_first(tokens[0], *grids[0], m)
            tokens = self.post_conv_layernorm(tokens)
            rows = torch.cat([r for r, _ in ids])
            cols = torch.cat([c for _, c in ids])
            heights = torch.cat([torch.full((h * w,), h, device=device) for h, w in grids])
            widths = torch.cat([torch.full((h * w,), w, device=device) for h, w in grids])
            # A static batch has one grid: its embeddings broadcast over the images.
            tokens = self.pos_embed(tokens, rows, cols, heights, widths)
        return tokens, rope, grids, seqlens

    def features(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes] = None):
        """-> (downsampled tokens (ΣN/m², out), merger output (ΣN/m², out)). Last stage only."""
        hidden, _, _ = self.encode(pixel_values, imgs_sizes=imgs_sizes)
        tokens = self.merger.downsampled(hidden)
        return tokens, self.merger.project(tokens)

    def forward(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None) -> torch.Tensor:
        hidden, _, _ = self.encode(pixel_values, attention_mask, imgs_sizes, packed_seq_params)
        if not self.post_process:
            return hidden
        return self.merger.downsampled(hidden)


def transformer_config(vc, params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    fields = transformer_fields(vc)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **fields)


def table_positions(vc) -> int:
    """Rows of the learned position table: (image_size / patch_size)², as transformers sizes it."""
    return (first_int(vc.image_size) // first_int(vc.patch_size)) ** 2


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Glm4vViTModel:
    """``Glm4vViTModel`` from an HF ``Glm4vMoeVisionConfig`` (or a whole config holding one)."""
    vc = getattr(cfg, "vision_config", None) or cfg
    p = first_int(vc.patch_size)
    return Glm4vViTModel(transformer_config(vc, params_dtype), vision_layer_spec(),
                         num_positions=table_positions(vc), intermediate_size=vc.intermediate_size,
                         norm_eps=vc.rms_norm_eps, activation=activation_from_hf(vc.hidden_act),
                         patch_dim=p, temporal_patch_size=first_int(vc.temporal_patch_size),
                         img_h=first_int(vc.image_size), img_w=first_int(vc.image_size),
                         in_channels=vc.in_channels, spatial_merge_size=vc.spatial_merge_size,
                         out_hidden_size=vc.out_hidden_size, rope_theta=rope_theta(vc))
