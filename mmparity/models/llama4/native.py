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

from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule

from mmparity.config import first_int
from mmparity.models.core.layers import tolerate_missing_extra_state
from mmparity.models.core.mla_moe import host_placement
from mmparity.models.core.stages import build_stage
from mmparity.models.llama4_vision import native as tower
from mmparity.models.llava.native import LLaVAModel


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


class Llama4VLModel(MegatronModule):
    def __init__(self, vision: Optional[Llama4VisionWithProjector], language_model, *, patch_dim: int,
                 image_token_id: int, vocab_size: int):
        super().__init__(config=language_model.config)
        self.language_model = language_model
        self.vision_model = vision.vision_model if vision is not None else None
        self.vision_projection = vision.vision_projection if vision is not None else None
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self.patch_dim, self.image_token_id, self.vocab_size = patch_dim, image_token_id, vocab_size
        tolerate_missing_extra_state(self)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.language_model.set_input_tensor(input_tensor)

    def pipelined_module(self) -> torch.nn.Module:
        return self.language_model

    def image_embeddings(self, tiles: torch.Tensor) -> torch.Tensor:
        """(tiles, C, S, S) -> (tiles · tokens per tile, text hidden)."""
        features = self.vision_model(tiles)
        return self.vision_projection(features.reshape(-1, features.shape[-1]))

    def embed(self, input_ids: torch.Tensor, tiles: Optional[torch.Tensor]) -> torch.Tensor:
        """``[s, b, h]`` decoder input: token embeddings with the image tokens' replaced."""
        image = input_ids == self.image_token_id
        ids = input_ids.masked_fill(image, 0)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        embedded = self.language_model.embedding(input_ids=ids, position_ids=positions)  # [s, b, h]
        if tiles is None:
            return embedded
        features = self.image_embeddings(tiles).to(embedded.dtype)
        if int(image.sum()) != features.shape[0]:
            raise ValueError(f"{int(image.sum())} image tokens in the ids for {features.shape[0]} image embeddings")
        batch_major = embedded.transpose(0, 1).clone()
        batch_major[image] = features
        return batch_major.transpose(0, 1).contiguous()

    def forward(self, tiles: Optional[torch.Tensor], input_ids: torch.Tensor, *,
                labels: Optional[torch.Tensor] = None):
        """Logits ``[b, s, padded vocab]``, or with ``labels`` (the next token at every position)
        Megatron's per-token loss over the real vocabulary ``[b, s]``; on a stage before the last,
        the hidden states it hands on."""
        with host_placement(input_ids.device):
            decoder_input = self.embed(input_ids, tiles) if self.pre_process else None
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            if labels is None or not self.post_process:
                return self.language_model(None, positions, None, decoder_input=decoder_input,
                                           runtime_gather_output=True)
            logits = self.language_model(None, positions, None, decoder_input=decoder_input)
            return LLaVAModel._token_loss(self, logits, labels.contiguous())


def build_native(cfg, params_dtype: torch.dtype = torch.float32, *, language) -> Llama4VLModel:
    """The whole model for a ``Llama4Config`` at this pipeline stage; ``language``: the
    language-model part's native module (its ``LanguageModelBuilder``)."""
    text = cfg.text_config
    vision, language_model = build_stage(cfg, text, language.LanguageModelBuilder(text, params_dtype),
                                         tower=lambda: Llama4VisionWithProjector(cfg, params_dtype))
    model = Llama4VLModel(vision, language_model, patch_dim=first_int(cfg.vision_config.patch_size),
                          image_token_id=cfg.image_token_id, vocab_size=text.vocab_size)
    return model.to(params_dtype)
