"""Kimi-K2.5 whole on mcore: the ``kimi_k25`` family's MoonViT and projector as ``vision_model`` /
``vision_projection`` and the registered language-model part (DeepSeek-V3's ``GPTModel``) as
``language_model``: ``LLaVAModel``'s tree, so the keys are Megatron's.

Images are laid out as Kimi's processor lays them out: every merged patch has one image token in
the ids (no compact placeholders to expand), and the projected image embeddings replace those
tokens' embeddings in order, row by row. Under pipeline parallelism the language model is split
over the stages; the tower and projector are whole on the first stage, as Megatron-LM keeps them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from megatron.core.transformer.module import MegatronModule

from mmparity.models.kimi_k25 import native as tower
from mmparity.models.core.layers import tolerate_missing_extra_state
from mmparity.models.core.mla_moe import host_placement
from mmparity.models.core.stages import build_stage
from mmparity.models.llava.native import LLaVAModel


class KimiK25VLModel(MegatronModule):
    def __init__(self, vision: Optional[tower.KimiViTWithProjector], language_model, *, patch_dim: int,
                 image_token_id: int, vocab_size: int):
        super().__init__(config=language_model.config)
        self.language_model = language_model
        self.vision_model = vision.vision_model if vision is not None else None
        self.vision_projection = vision.vision_projection if vision is not None else None
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self.patch_dim = patch_dim
        self.image_token_id = image_token_id
        self.vocab_size = vocab_size
        tolerate_missing_extra_state(self)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.language_model.set_input_tensor(input_tensor)

    def pipelined_module(self) -> torch.nn.Module:
        return self.language_model

    def image_embeddings(self, pixel_values: torch.Tensor, imgs_sizes=None,
                         num_frames: Optional[Sequence[int]] = None) -> torch.Tensor:
        out = self.vision_model.encode(pixel_values, imgs_sizes=imgs_sizes, num_frames=num_frames)
        return self.vision_projection(out.pooler_output)

    def embed(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor], imgs_sizes=None,
              num_frames: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``[s, b, h]`` decoder input: token embeddings with the image tokens' replaced."""
        image = input_ids == self.image_token_id
        ids = input_ids.masked_fill(image, 0)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        embedded = self.language_model.embedding(input_ids=ids, position_ids=positions)  # [s, b, h]
        if pixel_values is None:
            return embedded
        features = self.image_embeddings(pixel_values, imgs_sizes, num_frames)
        features = features.reshape(-1, embedded.shape[-1]).to(embedded.dtype)
        if int(image.sum()) != features.shape[0]:
            raise ValueError(f"{int(image.sum())} image tokens in the ids for {features.shape[0]} image embeddings")
        batch_major = embedded.transpose(0, 1).clone()
        batch_major[image] = features
        return batch_major.transpose(0, 1).contiguous()

    def forward(self, pixel_values: Optional[torch.Tensor], input_ids: torch.Tensor, *, imgs_sizes=None,
                num_frames: Optional[Sequence[int]] = None, labels: Optional[torch.Tensor] = None):
        """Logits ``[b, s, padded vocab]``, or with ``labels`` (the next token at every position)
        Megatron's per-token loss over the real vocabulary ``[b, s]``; on a stage before the last,
        the hidden states it hands on."""
        with host_placement(input_ids.device):
            decoder_input = (self.embed(input_ids, pixel_values, imgs_sizes, num_frames)
                             if self.pre_process else None)
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            if labels is None or not self.post_process:
                return self.language_model(None, positions, None, decoder_input=decoder_input,
                                           runtime_gather_output=True)
            logits = self.language_model(None, positions, None, decoder_input=decoder_input)
            # Megatron's loss over the real vocabulary only, as the LLaVA model computes it.
            return LLaVAModel._token_loss(self, logits, labels.contiguous())


def build_native(cfg, params_dtype: torch.dtype = torch.float32, *, language) -> KimiK25VLModel:
    """The whole model for a ``Kimi_K25Config`` at this pipeline stage; ``language``: the
    language-model part's native module (its ``LanguageModelBuilder``)."""
    text = cfg.text_config
    # The tower is never split; later stages only need its patch size, read off the config.
    vision, language_model = build_stage(
        cfg, text, language.LanguageModelBuilder(text, params_dtype),
        tower=lambda: tower.build_native(cfg, params_dtype))
    model = KimiK25VLModel(vision, language_model, patch_dim=tower._patch(cfg.vision_config),
                           image_token_id=cfg.image_token_id, vocab_size=text.vocab_size)
    return model.to(params_dtype)

