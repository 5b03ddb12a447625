"""Gemma 4 whole on mcore, ``LLaVAModel``'s tree: the ``gemma4_vision`` family's tower (pooled soft
tokens of images of any size, packed) as ``vision_model``, ``Gemma4MultimodalEmbedder`` (a
weightless RMSNorm, then a bias-free linear) as ``vision_projection`` and the ``gemma4_text``
part's decoder as ``language_model`` (a ``GPTModel``, its embedding scaled already).

Gemma 3 whole's composition (:class:`~mmparity.models.gemma3.native.Gemma3Model`: each image's
soft tokens take its run of image tokens in order; logits and per-token loss; pipeline stages)
with Gemma 4's images and mask: with ``use_bidirectional_attention`` "vision", the tokens of one
image attend to each other both ways on the sliding layers (the window still bounding how far back
a key may be), full layers stay causal; without it, every layer is causal.
"""

from __future__ import annotations

from typing import Optional

import torch

from mmparity.models.core.stages import build_stage
from mmparity.models.gemma3.native import Gemma3Model
from mmparity.models.gemma4_vision import native as tower
from mmparity.models.llama4.native import Projector
from mmparity.models.parts.gemma4_text import per_layer_native
from mmparity.models.parts.gemma4_text.native import rms_norm


class Embedder(Projector):
    """HF ``Gemma4MultimodalEmbedder``: a weightless RMSNorm (the tower's epsilon) before
    ``encoder.linear_fc1``, whole on every TP rank."""

    def __init__(self, config, in_features: int, out_features: int, eps: float):
        super().__init__(config, in_features, out_features)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(rms_norm(x, None, self.eps))


class Gemma4VisionWithEmbedder(torch.nn.Module):
    def __init__(self, cfg, params_dtype):
        super().__init__()
        vc = cfg.vision_config
        self.vision_model = tower.build_native(vc, params_dtype)
        self.vision_projection = Embedder(self.vision_model.config, vc.hidden_size, cfg.text_config.hidden_size,
                                          vc.rms_norm_eps)


class Gemma4Model(Gemma3Model):
    """ids and images -> logits or the per-token loss. Images are the processor's
    ``(pixel_values, pixel_position_ids)``, in the order their runs of image tokens appear."""

    def __init__(self, vision, projector, language_model, *, bidirectional: bool, placeholders=(),
                 pad_token_id: int = 0, **kwargs):
        super().__init__(vision, projector, language_model, **kwargs)
        self.bidirectional = bidirectional
        # E2B / E4B's per-layer inputs look the pad token up at multimodal positions.
        self.placeholders, self.pad_token_id = tuple(placeholders), pad_token_id

    def embed(self, input_ids: torch.Tensor, images) -> torch.Tensor:
        embedded = super().embed(input_ids, images)
        per_layer = getattr(self.language_model.embedding, "per_layer", None)
        if per_layer is not None:
            marks = torch.tensor(self.placeholders, dtype=input_ids.dtype, device=input_ids.device)
            per_layer(input_ids.masked_fill(torch.isin(input_ids, marks), self.pad_token_id), embedded)
        return embedded

    def forward(self, *args, **kwargs):
        relay = getattr(self.language_model, "per_layer_relay", None)
        try:
            return super().forward(*args, **kwargs)
        finally:
            if relay is not None:  # the per-layer inputs and shared keys / values of this forward only
                relay.clear()

    def image_features(self, images) -> torch.Tensor:
        pixel_values, positions = images
        return self.vision_projection(self.vision_model(pixel_values, positions))

    def scaled(self, embedded: torch.Tensor) -> torch.Tensor:
        return embedded  # the part's embedding scales its output itself

    def attention_mask(self, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        return super().attention_mask(input_ids) if self.bidirectional else None


def build_native(cfg, params_dtype: torch.dtype = torch.float32, *, language) -> Gemma4Model:
    """The whole model for a ``Gemma4Config`` at this pipeline stage; ``language``: the part's
    native module (its ``LanguageModelBuilder``)."""
    text = cfg.text_config
    builder = (per_layer_native if per_layer_native.needed(text) else language).LanguageModelBuilder
    vision, language_model = build_stage(cfg, text, builder(text, params_dtype),
                                         tower=lambda: Gemma4VisionWithEmbedder(cfg, params_dtype))
    model = Gemma4Model(vision.vision_model if vision else None, vision.vision_projection if vision else None,
                        language_model, image_token_id=cfg.image_token_id, vocab_size=text.vocab_size,
                        hidden_size=text.hidden_size,
                        bidirectional=getattr(text, "use_bidirectional_attention", None) == "vision",
                        placeholders=(cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id),
                        pad_token_id=text.pad_token_id)
    return model.to(params_dtype)
