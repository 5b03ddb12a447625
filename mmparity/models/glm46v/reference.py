"""Reference side of GLM-4.6V whole: transformers' ``Glm46VForConditionalGeneration`` with a GLM-4.5 MoE
text config, whose modules and names are GLM-4.5V whole's (``model.visual`` a ``Glm4vVisionModel``,
``model.language_model`` a ``Glm4vMoeTextModel``): its shapes are GLM-4.5V's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.models.glm4v_moe import reference as glm4v_moe
from mmparity.models.glm4v_moe.reference import state_shapes  # noqa: F401  (the same modules)
from mmparity.models.glm4v_vision import reference as tower

if TYPE_CHECKING:
    from transformers import Glm46VConfig

MODEL_TYPES = ("glm46v",)
MOE_TEXT_MODEL_TYPE = "glm4v_moe_text"


def tiny_config(**text_overrides) -> Glm46VConfig:
    """GLM-4.5V whole's tiny sizes under GLM-4.6V's class: the dense-model tower class, the MoE text model."""
    from transformers import Glm46VConfig

    text = glm4v_moe.tiny_text(**text_overrides) | {"model_type": MOE_TEXT_MODEL_TYPE}
    vision = tower.tiny_config().to_dict() | {"out_hidden_size": text["hidden_size"],
                                              "model_type": tower.DENSE_MODEL_TYPE}
    return Glm46VConfig(vision_config=vision, text_config=text, image_token_id=95, video_token_id=96,
                        image_start_token_id=91, image_end_token_id=92, video_start_token_id=93,
                        video_end_token_id=94, tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole GLM-4.6V config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole GLM-4.6V model")


def build(cfg):
    from transformers import Glm46VForConditionalGeneration

    model = Glm46VForConditionalGeneration(cfg).float().eval()
    model.set_experts_implementation("eager")
    return model
