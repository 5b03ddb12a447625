"""Reference side of Pixtral-Large: a Mistral3 model's vision tower and multimodal projector.

The family's HF unit is a whole ``Mistral3ForConditionalGeneration`` checkpoint; only what the
vision path needs is built (``PixtralVisionModel`` + ``Mistral3MultiModalProjector``), under the
attribute names ``Mistral3Model`` uses, so a whole checkpoint's ``vision_tower.*`` and
``multi_modal_projector.*`` tensors load as they are and the language model is never built.
The run follows ``Mistral3Model.get_image_features``: the tower's hidden state at
``vision_feature_layer``, then the projector (RMSNorm with the *text* config's epsilon, the 2x2
patch merger, linear_1 -> act -> linear_2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmparity.models.pixtral import reference as pixtral

if TYPE_CHECKING:
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

MODEL_TYPES = ("mistral3",)
OUTPUTS = ("merger", "projector")


def tiny_config() -> Mistral3Config:
    """Tiny Mistral3: Pixtral tower of 4 heads x 12, text hidden 40 (TP 2 and 4 divide both), a
    text ``rms_norm_eps`` far from the tower's 1e-5 so that taking the wrong epsilon shows, and
    projector biases on."""
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    vision = PixtralVisionConfig(hidden_size=48, intermediate_size=44, num_hidden_layers=2,
                                 num_attention_heads=4, image_size=64, patch_size=8,
                                 hidden_act="silu", num_channels=3)
    text = MistralConfig(hidden_size=40, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=20, vocab_size=64,
                         rms_norm_eps=1e-3)
    return Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                          projector_hidden_act="gelu", multimodal_projector_bias=True,
                          vision_feature_layer=-1)


def vision_config(cfg):
    """The family config is the whole Mistral3 config (the projector needs the text config)."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a Mistral3 "
                     "(Pixtral-Large) model")


class Mistral3VisionReference(torch.nn.Module):
    """``vision_tower`` + ``multi_modal_projector`` of ``Mistral3Model``, nothing else."""

    def __init__(self, cfg: Mistral3Config):
        super().__init__()
        if getattr(cfg.vision_config, "model_type", None) != "pixtral":
            raise ValueError(f"Mistral3 vision tower of model_type "
                             f"{getattr(cfg.vision_config, 'model_type', None)!r} is not Pixtral")
        from transformers import PixtralVisionModel
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        self.config = cfg
        self.vision_tower = PixtralVisionModel(cfg.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(cfg)


def build(cfg) -> Mistral3VisionReference:
    return Mistral3VisionReference(vision_config(cfg)).eval()


def projector_shapes(cfg) -> dict[str, tuple]:
    """``Mistral3MultiModalProjector``: the pre-merge norm, the patch merger and the two linears."""
    vision, text = cfg.vision_config.hidden_size, cfg.text_config.hidden_size
    layers = 1 if isinstance(cfg.vision_feature_layer, int) else len(cfg.vision_feature_layer)
    shapes = {"norm.weight": (vision,),
              "patch_merger.merging_layer.weight": (vision, vision * cfg.spatial_merge_size ** 2),
              "linear_1.weight": (text, vision * layers), "linear_2.weight": (text, text)}
    if cfg.multimodal_projector_bias:
        shapes |= {"linear_1.bias": (text,), "linear_2.bias": (text,)}
    return shapes


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    cfg = vision_config(cfg)
    return {**{"vision_tower." + k: s for k, s in pixtral.state_shapes(cfg.vision_config).items()},
            **{"multi_modal_projector." + k: s for k, s in projector_shapes(cfg).items()}}


def patch_size(cfg) -> int:
    return pixtral.patch_size(cfg.vision_config)
