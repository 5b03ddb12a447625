"""Reference side of Gemma 4 whole: transformers' ``Gemma4ForConditionalGeneration`` (the
``gemma4_vision`` tower, ``Gemma4MultimodalEmbedder``, the ``gemma4_text`` decoder, a tied head),
a tiny config of it and its state-dict shapes read off the config from its parts."""

from __future__ import annotations

from mmparity.config import tied_embeddings
from mmparity.models.gemma4_vision import reference as tower
from mmparity.models.llava.reference import fill_tied_head
from mmparity.models.parts.gemma4_text import reference as decoder

MODEL_TYPES = ("gemma4",)
# Token ids of the tiny vocabulary of 97 (padded to 128): begin / end of image around each image's
# run of soft tokens, as Gemma 4's processor writes them; audio's, which check refuses.
IMAGE, BOI, EOI, AUDIO, BOA, EOA, VIDEO = 90, 91, 92, 93, 94, 95, 96


def tiny_config(**text_overrides):
    """The ``gemma4_vision`` family's tiny tower and the ``gemma4_text`` part's tiny decoder, two
    layers each (the decoder's a sliding and a full one), its images attending to themselves both
    ways on sliding layers (``use_bidirectional_attention`` "vision", as the larger releases set
    it); no audio tower. Two layers each: Gemma 4's attention is unscaled on RMS-normed q/k, and
    under the harness's seeded weights each attention about doubles the fp32 rounding it is
    given, so a deeper tiny model would measure its depth, not the implementation (three and
    three came to 1.2e-5 on the bench's four 96x96 images, against the 1e-5 bound)."""
    from transformers import Gemma4Config

    text = decoder.tiny_text(use_bidirectional_attention="vision", num_hidden_layers=2,
                             layer_types=["sliding_attention", "full_attention"]) | text_overrides
    vision = tower.tiny_config().to_dict() | {"num_hidden_layers": 2}
    return Gemma4Config(vision_config=vision, text_config=text, audio_config=None,
                        image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI, audio_token_id=AUDIO,
                        boa_token_id=BOA, eoa_token_index=EOA, video_token_id=VIDEO,
                        architectures=["Gemma4ForConditionalGeneration"])


def tiny_e2b_config(**text_overrides):
    """:func:`tiny_config` as Gemma 4 E2B / E4B are made: per-layer inputs 6 wide (no divisor of
    the hidden size or the heads), four layers (sliding, full, sliding, full), the last two sharing
    the keys and values of the first two, their MLPs twice as wide."""
    return tiny_config(**({"num_hidden_layers": 4, "hidden_size_per_layer_input": 6, "vocab_size_per_layer_input": 97,
                           "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                           "layer_types": ["sliding_attention", "full_attention"] * 2} | text_overrides))


def vision_config(cfg):
    """The family config: a whole Gemma 4 config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole Gemma 4 model")


def build(cfg):
    import torch
    from transformers import Gemma4ForConditionalGeneration

    model = fill_tied_head(Gemma4ForConditionalGeneration(cfg).to(torch.float32).eval(), cfg)
    # Audio is out of scope (convert leaves the tower and its embedder out by name, no case carries
    # any): the model checked has neither, so a checkpoint with them (E2B / E4B) loads strictly.
    model.model.audio_tower = model.model.embed_audio = None
    if getattr(cfg.text_config, "enable_moe_block", False):
        # The eager experts, one by one: the grouped kernel refuses tiny widths (its strides).
        model.set_experts_implementation("eager")
    if tied_embeddings(cfg):
        # The state dict names the tied table once, as save_pretrained writes it (Gemma 3's reason).
        def once(module, state_dict, prefix, *unused):
            state_dict.pop(prefix + "lm_head.weight", None)

        model._register_state_dict_hook(once)
    return model


def state_shapes(cfg) -> dict[str, tuple]:
    """Under the module names; a tied head is not listed (:func:`build`'s state dict names the
    table once). An audio tower is not a shape this family converts (convert drops it by name)."""
    vc, text = cfg.vision_config, cfg.text_config
    shapes = {"model.vision_tower." + k: s for k, s in tower.state_shapes(vc).items()}
    shapes["model.embed_vision.embedding_projection.weight"] = (text.hidden_size, vc.hidden_size)
    shapes |= {"model.language_model." + k: s for k, s in decoder.decoder_shapes(text).items()}
    if not tied_embeddings(cfg):
        shapes["lm_head.weight"] = (text.vocab_size, text.hidden_size)
    return shapes
