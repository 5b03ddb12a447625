"""Native Qwen2.5-VL vision tower on an mcore ``TransformerBlock``: Qwen3.5's ``QwenVLViTModel``
(Conv3d patches, block-first order, 2D RoPE in rotate-half layout, a 2×2 merger; imported, not
restated) with what Qwen2.5-VL does differently.

Reference: transformers 5.24 ``Qwen2_5_VisionTransformerPretrainedModel``. Differences from the
parent:

* no learned position embedding, and a patch embedding without bias;
* RMSNorm in the blocks and the merger (``merger.patch_norm``, HF's ``ln_q``), a gated SiLU MLP
  with biases (``linear_fc1`` = [gate; up]);
* window attention. The merge units (m×m patches, consecutive in block-first order) of each image
  are reordered into windows of ``window_size // (patch_size·m)`` units a side, tiled from the
  top-left corner (partial windows at the right and bottom edges), windows in raster order and
  units in raster order inside a window. The tokens and their RoPE angles are reordered once
  before the blocks; the blocks listed in ``fullatt_block_indexes`` attend over each whole image,
  the others inside each window; the merger runs in window order and its output is put back in
  the processor's order.

Window attention in mcore: packed-sequence boundaries (THD ``PackedSeqParams``) over the
reordered tokens, one set per kind of block, handed to each layer by a forward pre-hook that
replaces the block's ``packed_seq_params``. Chosen over a per-layer attention mask because a
window is a contiguous run after the reorder: the packed kernels (flash / TE varlen on GPU,
grouped SDPA on CPU) then cost Σ window² instead of the N² of a dense masked attention, the same
kernels serve the full-attention blocks (per image), and mcore's THD RoPE takes per-token angles.

A static batch ``(B, C, H, W)`` runs as B packed images of one size.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import first_int, rope_theta
from mmparity.models.core.attention import make_packed_seq_params
from mmparity.models.core.layers import (
    activation_from_hf, numbered_layers, tolerate_missing_extra_state, vision_layer_spec,
    vision_transformer_config)
from mmparity.models.core.vit import ImageSizes
from mmparity.models.qwen2_5_vl.config import NORM_EPS, transformer_fields
from mmparity.models.qwen3_5.native import (
    QwenPatchMerger, QwenVLViTModel, block_first, block_first_ids)

Grid = Tuple[int, int]


def window_units(window_size: int, patch: int, merge: int) -> int:
    """The side of a window in merge units."""
    return window_size // merge // patch


def window_problems(window_size: int, patch: int, merge: int) -> list[str]:
    if window_units(window_size, patch, merge) < 1:
        return [f"window_size={window_size} is smaller than one merge unit (patch_size*"
                f"spatial_merge_size = {patch * merge} pixels): no window holds a token"]
    return []


def window_order(grids: Sequence[Grid], merge: int, side: int) -> Tuple[torch.Tensor, List[int]]:
    """``(order, units per window)`` for images of patch ``grids`` packed one after the other:
    ``order[k]`` is the merge unit (counted over the packed images, block-first) at place ``k``
    of the window order; windows never cross an image, so each image stays one contiguous run."""
    order, lengths, offset = [], [], 0
    for h, w in grids:
        gh, gw = h // merge, w // merge
        units = torch.arange(gh * gw).view(gh, gw) + offset
        for top in range(0, gh, side):
            for left in range(0, gw, side):
                window = units[top:top + side, left:left + side].reshape(-1)
                order.append(window)
                lengths.append(window.numel())
        offset += gh * gw
    return torch.cat(order), lengths


def reorder_units(x: torch.Tensor, order: torch.Tensor, unit: int, dim: int) -> torch.Tensor:
    """``x`` with the runs of ``unit`` consecutive entries along ``dim`` taken in ``order``."""
    shape = x.shape
    runs = x.reshape(*shape[:dim], shape[dim] // unit, unit, *shape[dim + 1:])
    return runs.index_select(dim, order.to(x.device)).reshape(shape)


class RMSNormMerger(QwenPatchMerger):
    """HF's ``Qwen2_5_VLPatchMerger`` in the parent's layout: ``patch_norm`` (HF's ``ln_q``) is an
    RMSNorm without bias; fc1, exact GELU, fc2 as the parent's."""

    def __init__(self, config: TransformerConfig, hidden_size: int, spatial_merge_size: int,
                 out_hidden_size: int, eps: float = NORM_EPS):
        super().__init__(config, hidden_size, spatial_merge_size, out_hidden_size, eps)
        self.patch_norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)


class Qwen25VLViTModel(QwenVLViTModel):
    """Native Qwen2.5-VL vision encoder: pixels ``(B, C, H, W)``, or packed processor rows
    ``(1, ΣN, D)`` / ``(ΣN, D)`` with ``imgs_sizes``. :meth:`encode` runs the blocks in window
    order; :meth:`features` gives the merger's input tokens and output in the processor's order."""

    def __init__(self, transformer_config: TransformerConfig, transformer_layer_spec, *,
                 window_size: int, fullatt_block_indexes: Sequence[int], **kwargs):
        super().__init__(transformer_config, transformer_layer_spec, num_pos_per_side=1, **kwargs)
        problems = window_problems(window_size, self.patch_dim, self.spatial_merge_size)
        if problems:
            raise ValueError("; ".join(problems))
        self.window_side = window_units(window_size, self.patch_dim, self.spatial_merge_size)
        self.fullatt_block_indexes = frozenset(int(i) for i in fullatt_block_indexes)
        self.pos_embed = None
        if self.patch_embed is not None:
            self.patch_embed.proj.register_parameter("bias", None)
        if self.post_process:
            self.merger = RMSNormMerger(transformer_config, transformer_config.hidden_size,
                                        self.spatial_merge_size, kwargs.get("out_hidden_size", 2048))
        tolerate_missing_extra_state(self)

    def embed(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes] = None):
        """-> (tokens (1, ΣN, H) block-first or None off the first stage, rotary (ΣN, 1, 1, d),
        grids, static batch size or None)."""
        m = self.spatial_merge_size
        pixel_values, grids, seqlens = self.patch_grids(pixel_values, imgs_sizes)
        # A static batch runs as B packed images of one size.
        batch = None if seqlens is not None else pixel_values.shape[0]
        tokens = None
        if self.pre_process:
            tokens = self.patch_embed(pixel_values)
            if batch is not None:
                tokens = block_first(tokens[0], *grids[0], m)
                tokens = tokens.reshape(1, -1, tokens.shape[-1])
        if batch is not None:
            grids = grids * batch
        device = pixel_values.device
        rope = torch.cat([self.rotary_pos_emb(*block_first_ids(h, w, m, device)) for h, w in grids])
        return tokens, rope, grids, batch

    def encode(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
               imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None):
        """The blocks: -> (hidden (1, ΣN, H) in window order, grids, window order of the merge
        units, static batch size or None)."""
        if packed_seq_params is not None:
            raise ValueError("the Qwen2.5-VL tower makes its own packed-sequence boundaries "
                             "(per window and per image)")
        tokens, rope, grids, batch = self.embed(pixel_values, imgs_sizes)
        unit = self.spatial_merge_size ** 2
        order, lengths = window_order(grids, self.spatial_merge_size, self.window_side)
        if tokens is not None:
            tokens = reorder_units(tokens, order, unit, dim=1)
        rope = reorder_units(rope, order, unit, dim=0)
        whole = make_packed_seq_params([h * w for h, w in grids])
        windows = make_packed_seq_params([n * unit for n in lengths])

        def boundaries(layer_index):
            params = whole if layer_index in self.fullatt_block_indexes else windows

            def hook(_module, args, kwargs):
                return args, {**kwargs, "packed_seq_params": params}
            return hook

        handles = [layer.register_forward_pre_hook(boundaries(i), with_kwargs=True)
                   for i, layer in numbered_layers(self.decoder)]
        try:
            hidden = self.run_stack(tokens, rope, None, attention_mask, whole)
        finally:
            for handle in handles:
                handle.remove()
        return hidden, grids, order, batch

    def features(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes] = None):
        """-> (merger input tokens (B, N/m², m²·H), merger output (B, N/m², out)) in the processor's
        order: B images of a static batch, or B = 1 for packed images. Last stage only."""
        hidden, grids, order, batch = self.encode(pixel_values, imgs_sizes=imgs_sizes)
        hs, ws = [h for h, _ in grids], [w for _, w in grids]
        tokens = self.merger.encoder_tokens(hidden, hs, ws)
        pooled = self.merger.project(tokens)
        back = torch.argsort(order)
        tokens, pooled = (reorder_units(t, back, 1, dim=1) for t in (tokens, pooled))
        if batch is not None:
            tokens, pooled = (t.reshape(batch, -1, t.shape[-1]) for t in (tokens, pooled))
        return tokens, pooled

    def forward(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None) -> torch.Tensor:
        if not self.post_process:
            return self.encode(pixel_values, attention_mask, imgs_sizes, packed_seq_params)[0]
        return self.features(pixel_values, imgs_sizes)[0]


def transformer_config(vc, params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    fields = transformer_fields(vc)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **fields)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Qwen25VLViTModel:
    """``Qwen25VLViTModel`` from an HF ``Qwen2_5_VLVisionConfig`` (or a whole ``Qwen2_5_VLConfig``)."""
    vc = getattr(cfg, "vision_config", None) or cfg
    p = first_int(vc.patch_size)
    return Qwen25VLViTModel(transformer_config(vc, params_dtype), vision_layer_spec(),
                            window_size=vc.window_size, fullatt_block_indexes=vc.fullatt_block_indexes,
                            patch_dim=p, temporal_patch_size=first_int(vc.temporal_patch_size),
                            img_h=p * vc.spatial_merge_size, img_w=p * vc.spatial_merge_size,
                            in_channels=vc.in_channels, spatial_merge_size=vc.spatial_merge_size,
                            out_hidden_size=vc.out_hidden_size, rope_theta=rope_theta(vc))
