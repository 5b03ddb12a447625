"""Reference side of Qwen3-VL's vision tower: transformers' ``Qwen3VLVisionModel``.

The tower is Qwen3.5-MoE's (same patch embedding, resampled position table, 2D RoPE, blocks and
main merger) plus DeepStack: the hidden states after each layer of ``deepstack_visual_indexes``
go through their own merger (``deepstack_merger_list``, whose LayerNorm runs after the 2×2
grouping, over m²·H) and come out as ``deepstack_features``, which the language model adds to its
first decoder layers' hidden states at the image tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import tower_config
from mmparity.models.qwen3_5 import reference as tower

if TYPE_CHECKING:
    from transformers import Qwen3VLVisionConfig

    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

MODEL_TYPES = ("qwen3_vl_vision",)
# Whole-VLM configs that carry this tower as ``vision_config``.
PARENT_MODEL_TYPES = ("qwen3_vl",)
OUTPUTS = tower.OUTPUTS


def deepstack_outputs(cfg) -> tuple:
    """The names of the DeepStack features compared, one per tapped layer, bottom-up (the order
    transformers emits them in and the decoder layers take them in, not the list's)."""
    return tuple(f"deepstack_{j}" for j in range(len(cfg.deepstack_visual_indexes)))


def tiny_config() -> Qwen3VLVisionConfig:
    """Qwen3.5's awkward tiny tower (4 heads of 12, FFN 44, patch 5, out 36, a 5×5 table) with
    three layers and DeepStack taps after layers 0 and 1, listed out of order: the list's order
    numbers the mergers, the layers' order the features, and a swap of either shows."""
    from transformers import Qwen3VLVisionConfig

    return Qwen3VLVisionConfig(depth=3, hidden_size=48, intermediate_size=44, num_heads=4,
                               in_channels=3, patch_size=5, temporal_patch_size=2,
                               spatial_merge_size=2, out_hidden_size=36,
                               num_position_embeddings=25, hidden_act="gelu_pytorch_tanh",
                               deepstack_visual_indexes=[1, 0])


def vision_config(cfg):
    """The vision config inside ``cfg`` (itself, or a ``Qwen3VLConfig``'s ``vision_config``)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "Qwen3-VL vision")


def build(cfg) -> Qwen3VLVisionModel:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return Qwen3VLVisionModel(cfg).eval()


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config: Qwen3.5's tower and one
    post-shuffle merger per DeepStack tap."""
    h = cfg.hidden_size
    merged = h * cfg.spatial_merge_size ** 2
    merger = {"norm.weight": (merged,), "norm.bias": (merged,),
              "linear_fc1.weight": (merged, merged), "linear_fc1.bias": (merged,),
              "linear_fc2.weight": (cfg.out_hidden_size, merged), "linear_fc2.bias": (cfg.out_hidden_size,)}
    return {**tower.state_shapes(cfg),
            **{f"deepstack_merger_list.{j}.{k}": s for j in range(len(cfg.deepstack_visual_indexes))
               for k, s in merger.items()}}
