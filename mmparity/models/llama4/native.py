"""Llama 4 whole on mcore: the ``llama4_vision`` family's tower (its pixel-shuffle adapter
included) as ``vision_model``, the projector linear as ``vision_projection`` and the registered
language-model part (the Llama 4 ``GPTModel``) as ``language_model``: ``LLaVAModel``'s tree, so
the keys are Megatron's.

Images come as tiles (``image_size`` squares, any number per image, as transformers' processor
cuts them); every pixel-shuffled token of every tile has one image token in the ids, and the
projected tokens replace those tokens' embeddings in order, row by row. Under pipeline
parallelism the language model is split over the stages; the tower and projector are whole on the
first stage, as Megatron-LM keeps them.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from mmparity.config import first_int
from mmparity.models.core.stages import build_stage
from mmparity.models.kimi_k25_vl.native import KimiK25VLModel
from mmparity.models.llama4_vision import native as tower


class Projector(MegatronModule):
    """transformers' ``multi_modal_projector``: one bias-free linear (``MultimodalProjector``'s
    affine name, ``encoder.linear_fc1``), whole on every TP rank."""

    def __init__(self, config, in_features: int, out_features: int):
        super().__init__(config=config)
        self.encoder = torch.nn.Module()
        self.encoder.linear_fc1 = torch.nn.Linear(in_features, out_features, bias=False, dtype=config.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder.linear_fc1(x)


class Llama4VisionWithProjector(torch.nn.Module):
    def __init__(self, cfg, params_dtype):
        super().__init__()
        self.vision_model = tower.build_native(cfg.vision_config, params_dtype)
        self.vision_projection = Projector(self.vision_model.config, cfg.vision_config.vision_output_dim,
                                           cfg.text_config.hidden_size)


class Llama4VLModel(KimiK25VLModel):
    """Kimi-K2.5 whole's composition (the image tokens' embeddings replaced in order, the language
    model's stages, its logits and loss) with Llama 4's image path: a batch of tiles through the
    tower (its adapter included), every output token through the projector."""

    def image_embeddings(self, tiles: torch.Tensor, imgs_sizes=None, num_frames=None) -> torch.Tensor:
        """(tiles, C, S, S) -> (tiles · tokens per tile, text hidden); tiles take no sizes or frames."""
        features = self.vision_model(tiles)
        return self.vision_projection(features.reshape(-1, features.shape[-1]))


def build_native(cfg, params_dtype: torch.dtype = torch.float32, *, language) -> Llama4VLModel:
    """The whole model for a ``Llama4Config`` at this pipeline stage; ``language``: the
    language-model part's native module (its ``LanguageModelBuilder``)."""
    text = cfg.text_config
    vision, language_model = build_stage(cfg, text, language.LanguageModelBuilder(text, params_dtype),
                                         tower=lambda: Llama4VisionWithProjector(cfg, params_dtype))
    model = Llama4VLModel(vision, language_model, patch_dim=first_int(cfg.vision_config.patch_size),
                          image_token_id=cfg.image_token_id, vocab_size=text.vocab_size)
    return model.to(params_dtype)
