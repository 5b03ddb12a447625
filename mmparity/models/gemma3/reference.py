"""Reference side of Gemma 3 whole: transformers' ``Gemma3ForConditionalGeneration`` (a SigLIP tower
without its pooling head, ``Gemma3MultiModalProjector``, ``Gemma3TextModel``, a tied head), and its
state-dict shapes read off the config."""

from __future__ import annotations

from mmparity.config import tied_embeddings
from mmparity.models.llava.reference import fill_tied_head, whole_model_shapes
from mmparity.models.siglip import reference as tower

MODEL_TYPES = ("gemma3",)
# Token ids of the tiny vocabulary of 97 (padded to 128): begin / end of image around each image's
# run of image tokens, as Gemma 3's processor writes them.
IMAGE, BOI, EOI = 9, 7, 8


def tiny_text(**overrides) -> dict:
    """Three layers, sliding / full / sliding, a window of 5 (shorter than every row), GQA 4 heads
    in 2 groups (TP 2 divides both) of width 12 (not hidden / heads), an attention scale that is not
    head_dim's, local and global RoPE bases apart with linear scaling on the global one, a vocabulary of 97 that needs padding."""
    text = dict(vocab_size=97, hidden_size=40, intermediate_size=52, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, sliding_window=5,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=10,
                max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 3000.0}})
    return text | overrides


def tiny_config(**text_overrides):
    """A SigLIP tower of 32x32 images in 8x8 patches (a 4x4 grid, pooled 2x2 to 4 tokens per image)
    without its pooling head; the decoder of :func:`tiny_text`."""
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=48, intermediate_size=52, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8, num_channels=3, hidden_act="gelu_pytorch_tanh",
                                layer_norm_eps=1e-6, vision_use_head=False)
    return Gemma3Config(vision_config=vision.to_dict(), text_config=tiny_text(**text_overrides), mm_tokens_per_image=4,
                        image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI,
                        architectures=["Gemma3ForConditionalGeneration"])


def vision_config(cfg):
    """The family config: a whole Gemma 3 config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole Gemma 3 model")


def build(cfg):
    import torch
    from transformers import Gemma3ForConditionalGeneration

    model = fill_tied_head(Gemma3ForConditionalGeneration(cfg).to(torch.float32).eval(), cfg)
    if tied_embeddings(cfg):
        # The state dict names the tied table once, as save_pretrained writes it: a second name
        # would be a second tensor to whatever reads it by name (seeded weights, the low-memory
        # check's streaming); the head is read from the embedding on load (fill_tied_head).
        def once(module, state_dict, prefix, *unused):
            state_dict.pop(prefix + "lm_head.weight", None)

        model._register_state_dict_hook(once)
    return model


def decoder_shapes(text) -> dict[str, tuple]:
    h, f, d = text.hidden_size, text.intermediate_size, text.head_dim
    q, kv = text.num_attention_heads * d, text.num_key_value_heads * d
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    return {"embed_tokens.weight": (text.vocab_size, h),
            **{f"layers.{i}.{k}": s for i in range(text.num_hidden_layers) for k, s in layer.items()},
            "norm.weight": (h,)}


def state_shapes(cfg) -> dict[str, tuple]:
    """Under the module names; a tied head is not listed (:func:`build`'s state dict names the
    table once)."""
    vc, text = cfg.vision_config, cfg.text_config
    projector = {"mm_input_projection_weight": (vc.hidden_size, text.hidden_size),
                 "mm_soft_emb_norm.weight": (vc.hidden_size,)}
    shapes = whole_model_shapes(cfg, tower.state_shapes, projector, decoder_shapes)
    if tied_embeddings(cfg):
        del shapes["lm_head.weight"]
    return shapes
