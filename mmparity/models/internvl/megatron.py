"""Megatron's classes for whole InternVL: stock ``LLaVAModel`` (``vision_model_type`` internvit),
and its parts alone: the language model in its part's ``GPTModel``, the vision part in stock
``CLIPViTModel`` (the internvit family's class) with the ``MultimodalProjector``, the projector."""

from __future__ import annotations

from dataclasses import replace

import torch

from mmparity.config import image_hw, pixel_shuffle_reduction, tower_depth
from mmparity.models.core import inputs, megatron_side
from mmparity.models.core import megatron_classes as upstream
from mmparity.models.internvit import megatron as internvit_megatron
from mmparity.models.internvl import tower_output_refusal
from mmparity.models.llava import megatron as llava_megatron
from mmparity.models.llava.preprocess import pixel_shuffle
from mmparity.models.spec import Case, MegatronClass

def build_vision(cfg, params_dtype=torch.float32):
    """The tower (stock ``CLIPViTModel`` as InternViT, as deep as the features read) and the
    normed projector, under ``LLaVAModel``'s names."""
    tower = internvit_megatron.build_internvit(cfg.vision_config, params_dtype, tower_depth(cfg))
    return upstream.VisionWithProjection(tower, llava_megatron.build_projector(cfg, params_dtype)).eval()


def vision_cases(hooks, cfg, seed: int, image_sizes) -> list[Case]:
    side = image_hw(cfg.vision_config)
    if image_sizes and any(tuple(s) != side for s in image_sizes):
        raise megatron_side.UnsupportedInput(f"InternVL's tiles are {side[0]}x{side[1]}: "
                                             "Megatron's CLIPViTModel takes that size only")
    sizes = [tuple(s) for s in image_sizes] if image_sizes else [side] * 3
    images = inputs.images(sizes, cfg.vision_config.num_channels, seed)
    return [Case("tiles", {"images": images, "sizes": sizes}, ("vision_projection",),
                 description=f"{len(sizes)} tiles {side[0]}x{side[1]} through the tower, pixel shuffle "
                             "and projector")]


def _shuffled(hidden: torch.Tensor, cfg) -> torch.Tensor:
    """(tiles, 1 + h·w, H) tower output -> (tiles·h·w/r², r²·H): class token dropped, shuffled."""
    r = pixel_shuffle_reduction(cfg)
    return pixel_shuffle(hidden[:, 1:], 1 / r).reshape(-1, hidden.shape[-1] * r * r)


def run_vision(model, case: Case, cfg) -> dict:
    tower = model.vision_model
    hidden = upstream.run_clip(tower, case.data["images"]).tokens.view(len(case.data["images"]), -1,
                                                                       cfg.vision_config.hidden_size)
    projected = model.vision_projection(_shuffled(hidden, cfg).unsqueeze(1))
    return {"vision_projection": projected.reshape(-1, projected.shape[-1])}


def reference_vision(model, case: Case, cfg) -> dict:
    """transformers' image features, from the selected layer's hidden state before the tower's
    final LayerNorm (which Megatron's class has no place for; Identity in InternVL3's towers)."""
    parameter = next(model.parameters())
    pixels = torch.stack(case.data["images"]).to(parameter.device, parameter.dtype)
    hidden = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[cfg.vision_feature_layer]
    return {"vision_projection": model.model.multi_modal_projector(_shuffled(hidden, cfg))}


VISION = MegatronClass(build_vision, vision_cases, run_vision, megatron_side.no_pairs,
                       reference_run=reference_vision, module_cases=(),
                       note="the vision part (vision_model.*, vision_projection.*) on tiles; transformers' "
                            "features before the tower's final LayerNorm",
                       holds=("vision_model.", "vision_projection."))

# Stock LLaVAModel holds the whole model (its tower built on the internvit family's InternViT
# layer spec, its own 2x2 pixel shuffle, the normed projector) where it computes InternVL
# (``tower_output_refusal``, which the record reads too); the parts beside it.

MEGATRON = {"LLaVAModel": replace(llava_megatron.LLAVA_MODEL, default_config=None, refuses=tower_output_refusal),
            "GPTModel": llava_megatron.LANGUAGE_MODEL, "CLIPViTModel+MultimodalProjector": VISION,
            "MultimodalProjector": llava_megatron.PROJECTION}
