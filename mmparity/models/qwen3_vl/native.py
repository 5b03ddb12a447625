"""Native Qwen3-VL vision tower: Qwen3.5-MoE's ``QwenVLViTModel`` (the same computation up to the
main merger, imported, not restated) plus DeepStack.

DeepStack: after each layer listed in ``deepstack_visual_indexes`` the block-first hidden states
are grouped m×m (as the main merger groups them), normalised over the grouped width m²·H (HF's
post-shuffle LayerNorm), and projected fc1 -> exact GELU -> fc2 to the language model's width.
Merger ``j`` serves the layer named by the ``j``-th entry of the list, but the features come out
in the order of the layers (as transformers emits them): the language model adds feature ``k``,
the ``k``-th tapped layer from the bottom, after its decoder layer ``k``. The two orders differ
only where the list is not ascending.

Layout: the DeepStack mergers are ``deepstack_merger_list.{j}.{patch_norm,linear_fc1,linear_fc2}``,
named and kept as the main merger is (plain modules, whole on every TP rank). They sit on the last
pipeline stage with the main merger, so the native tower refuses pipeline parallelism for a check
(a tap on an earlier stage would need its hidden states sent on); conversion takes any PP.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import first_int, rope_theta
from mmparity.models.core.layers import numbered_layers, tolerate_missing_extra_state, vision_layer_spec
from mmparity.models.qwen3_5.config import NORM_EPS
from mmparity.models.qwen3_5.native import QwenVLViTModel, _as_grids, check_grid, table_side
from mmparity.models.qwen3_5.native import transformer_config as tower_transformer_config


def deepstack_problems(indexes: Sequence[int], depth: int) -> list[str]:
    """What of ``deepstack_visual_indexes`` no tower computes as listed: a tap past the last layer
    (HF never fires it and its merger's feature is missing) or a layer tapped twice (HF feeds the
    first merger of that layer and leaves the other unused)."""
    out = []
    bad = [i for i in indexes if not 0 <= int(i) < depth]
    if bad:
        out.append(f"deepstack_visual_indexes {list(indexes)} name layers {bad} outside the tower's "
                   f"{depth} layers (depth)")
    if len(set(indexes)) != len(indexes):
        out.append(f"deepstack_visual_indexes {list(indexes)} tap a layer twice")
    return out


class DeepStackMerger(MegatronModule):
    """HF's post-shuffle ``Qwen3VLVisionPatchMerger``: m×m grouping of block-first tokens, then
    LayerNorm over m²·H, fc1, exact GELU, fc2 (plain ``nn.Linear``s whole on every TP rank, as the
    main merger's)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, spatial_merge_size: int,
                 out_hidden_size: int, eps: float = NORM_EPS):
        super().__init__(config=config)
        self.hidden_size, self.spatial_merge_size = hidden_size, spatial_merge_size
        merged = hidden_size * spatial_merge_size ** 2
        self.patch_norm = torch.nn.LayerNorm(merged, eps=eps, dtype=config.params_dtype)
        self.linear_fc1 = torch.nn.Linear(merged, merged, bias=True, dtype=config.params_dtype)
        self.linear_fc2 = torch.nn.Linear(merged, out_hidden_size, bias=True, dtype=config.params_dtype)

    def forward(self, x: torch.Tensor, h_patches, w_patches) -> torch.Tensor:
        """(B, N, H) block-first -> (B, N/m², out); grid sequences describe one packed sequence."""
        m = self.spatial_merge_size
        grids = _as_grids(h_patches, w_patches)
        for h, w in grids:
            check_grid(h, w, m)
        total = sum(h * w for h, w in grids)
        if x.dim() != 3 or x.shape[1] != total:
            raise ValueError(f"DeepStack merger input {tuple(x.shape)} does not hold the {total} "
                             f"tokens of grid(s) {grids}")
        grouped = x.reshape(x.shape[0], total // (m * m), m * m * self.hidden_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(self.patch_norm(grouped))))


class Qwen3VLViTModel(QwenVLViTModel):
    """Qwen3.5's tower with DeepStack taps. ``encode`` and ``forward`` are the parent's;
    :meth:`encode_deepstack` also returns the hidden states after each tapped layer, and
    :meth:`deepstack` turns them into the DeepStack features."""

    def __init__(self, transformer_config: TransformerConfig, transformer_layer_spec, *,
                 deepstack_visual_indexes: Sequence[int], **kwargs):
        super().__init__(transformer_config, transformer_layer_spec, **kwargs)
        self.deepstack_visual_indexes = tuple(int(i) for i in deepstack_visual_indexes)
        problems = deepstack_problems(self.deepstack_visual_indexes, transformer_config.num_layers)
        if problems:
            raise ValueError("; ".join(problems))
        self.deepstack_merger_list = None
        if self.post_process:
            self.deepstack_merger_list = torch.nn.ModuleList(
                DeepStackMerger(transformer_config, transformer_config.hidden_size,
                                self.spatial_merge_size, kwargs.get("out_hidden_size", 2048))
                for _ in self.deepstack_visual_indexes)
        tolerate_missing_extra_state(self)

    def encode_deepstack(self, pixel_values: torch.Tensor, imgs_sizes=None, packed_seq_params=None):
        """-> (hidden (B, N, H), h_patches, w_patches, [tapped hidden (B, N, H) per tapped layer,
        bottom-up])."""
        taps: dict = {}
        handles = []
        for index, layer in numbered_layers(self.decoder):
            if index in self.deepstack_visual_indexes:
                # The layer's output is ([s, b, h], context), which the next layer's residual add
                # updates in place: a copy, batch-first for the mergers.
                handles.append(layer.register_forward_hook(
                    lambda _m, _i, out, index=index: taps.__setitem__(index, out[0].transpose(0, 1).clone())))
        try:
            hidden, h, w = self.encode(pixel_values, imgs_sizes=imgs_sizes,
                                       packed_seq_params=packed_seq_params)
        finally:
            for handle in handles:
                handle.remove()
        return hidden, h, w, [taps[i] for i in sorted(self.deepstack_visual_indexes)]

    def deepstack(self, taps: List[torch.Tensor], h_patches, w_patches) -> List[torch.Tensor]:
        """The DeepStack features, in layer order: ``taps`` are the tapped layers' hidden states
        bottom-up, each through the merger its layer's entry of the list names."""
        order = sorted(self.deepstack_visual_indexes)
        return [self.deepstack_merger_list[self.deepstack_visual_indexes.index(layer)](tap, h_patches, w_patches)
                for layer, tap in zip(order, taps)]


def build_native(cfg, params_dtype: torch.dtype = torch.float32,
                 deepstack_visual_indexes: Optional[Sequence[int]] = None) -> Qwen3VLViTModel:
    """``Qwen3VLViTModel`` from an HF ``Qwen3VLVisionConfig`` (or a whole ``Qwen3VLConfig``)."""
    vc = getattr(cfg, "vision_config", None) or cfg
    g, p = table_side(vc), first_int(vc.patch_size)
    indexes = vc.deepstack_visual_indexes if deepstack_visual_indexes is None else deepstack_visual_indexes
    return Qwen3VLViTModel(tower_transformer_config(vc, params_dtype), vision_layer_spec(),
                           deepstack_visual_indexes=indexes, patch_dim=p,
                           temporal_patch_size=first_int(vc.temporal_patch_size), img_h=g * p,
                           img_w=g * p, in_channels=vc.in_channels,
                           spatial_merge_size=vc.spatial_merge_size,
                           out_hidden_size=vc.out_hidden_size, num_pos_per_side=g,
                           rope_theta=rope_theta(vc))
