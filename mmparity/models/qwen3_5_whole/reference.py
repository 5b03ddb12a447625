"""Reference side of Qwen3.5 whole: transformers' ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``, and their state-dict shapes read off the config (the
qwen3_5 tower's under ``model.visual.``, the qwen3_5_text part's under ``model.language_model.``)."""

from __future__ import annotations

from mmparity.config import tied_embeddings
from mmparity.models.parts.qwen3_5_text import reference as decoder
from mmparity.models.parts.qwen3_5_text.config import is_moe
from mmparity.models.qwen3_5 import reference as tower
from mmparity.models.qwen3_5_lm import reference as text_model

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# Token ids at the top of the tiny vocabulary of 101.
IMAGE, VIDEO, START, END = 99, 100, 97, 98


def tiny_text(moe: bool = True, **overrides) -> dict:
    """The qwen3_5_lm family's awkward tiny decoder (2 key heads serving 4 value heads; 6 experts
    choose 2) in three layers, attention, DeltaNet, attention, with heads of 16 whose first half
    rotates: 4 frequencies, dealt t h w t by the interleaved M-RoPE split [2, 1, 1].

    Three layers, not four: under the harness's seeded weights (zero-centred norms at 1 ± 0.2,
    an effective scale of 2) each Gated DeltaNet layer amplifies the fp32 noise the tower's
    features bring in several times over, and a second one takes the logits to the 1e-5 bound
    at some seeds; the parity itself is that of each layer (tests/models/test_qwen3_5_whole.py)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = text_model.tiny_config(moe=moe, head_dim=16, rope_parameters=rope, num_hidden_layers=3,
                                  layer_types=["full_attention", "linear_attention", "full_attention"]).to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype"):
        text.pop(key, None)
    return text | overrides


def tiny_config(moe: bool = True, **text_overrides):
    import transformers

    vision = tower.tiny_config().to_dict()
    vision.pop("model_type", None)
    vision["out_hidden_size"] = tiny_text(moe)["hidden_size"]
    cls, arch = ((transformers.Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration") if moe
                 else (transformers.Qwen3_5Config, "Qwen3_5ForConditionalGeneration"))
    return cls(vision_config=vision, text_config=tiny_text(moe, **text_overrides), image_token_id=IMAGE,
               video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
               tie_word_embeddings=False, architectures=[arch])


def vision_config(cfg):
    """The family config: a whole Qwen3.5 / Qwen3.5-MoE config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole Qwen3.5 model "
                     f"(expected one of {MODEL_TYPES})")


def build(cfg):
    import torch
    import transformers

    cls = (transformers.Qwen3_5MoeForConditionalGeneration if is_moe(cfg.text_config)
           else transformers.Qwen3_5ForConditionalGeneration)
    model = cls(cfg).to(torch.float32).eval()
    if is_moe(cfg.text_config):
        # As qwen3_5_lm's reference: each expert as the modelling code writes it (the grouped-GEMM
        # path needs 16-byte-aligned strides, which bf16 at odd tiny widths lacks).
        model.set_experts_implementation("eager")
    return model


def state_shapes(cfg) -> dict[str, tuple]:
    text = cfg.text_config
    out = {f"model.visual.{k}": s for k, s in tower.state_shapes(cfg.vision_config).items()}
    out.update({f"model.language_model.{k}": s for k, s in decoder.decoder_shapes(text).items()})
    if not tied_embeddings(cfg):
        out["lm_head.weight"] = (text.vocab_size, text.hidden_size)
    return out


# Qwen3.5-397B-A17B's configuration (recalled from its release and Megatron-side launch scripts
# that reproduce it; the benchmarks cannot reach the hub): 60 layers in 15 groups of three Gated
# DeltaNet layers and one gated-attention layer, every MLP 512 routed experts (10 chosen) of width
# 1024 plus a shared expert of 1024, attention 32 query / 2 key-value heads of 256, DeltaNet 16
# key / 64 value heads of 128, a quarter of each attention head rotated; the Qwen3-VL-style tower
# (27 x 1152) merged into the text width; one multi-token-prediction layer.
PUBLISHED_TEXT = dict(vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                      num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=64,
                      moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts=512,
                      num_experts_per_tok=10, rms_norm_eps=1e-6, max_position_embeddings=262144,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                       "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                       "mrope_interleaved": True})
PUBLISHED_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                        patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                        num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")
PUBLISHED_MTP_LAYERS = 1


def published_config(scale: int = 1, layers: int | None = None, experts: int | None = None,
                     heads: int | None = None):
    """The Qwen3.5-397B-A17B config, or a proportionally scaled one: every width and the expert
    count divided by ``scale`` (head counts kept, head widths cut, so the TP and EP splits stay
    the release's), ``layers`` decoder layers (the release's 3:1 pattern kept) and ``experts``
    routed experts per layer if given, ``heads`` attention query heads if given."""
    import transformers

    def cut(n: int, least: int = 2) -> int:
        # Even, so TP 2 and EP 2 split every scaled width and the expert count.
        return n if scale == 1 else max(least, n // scale // 2 * 2)

    text = dict(PUBLISHED_TEXT)
    for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "num_experts"):
        text[name] = cut(text[name])
    # Head widths shrink, the rotated quarter of an attention head staying whole pairs (M-RoPE's
    # 11 + 11 + 10 frequencies need a rotated width of 64: a head of 256).
    text["linear_key_head_dim"] = text["linear_value_head_dim"] = cut(128, 4)
    text["num_experts_per_tok"] = min(text["num_experts_per_tok"], text["num_experts"])
    depth = layers if layers is not None else text["num_hidden_layers"]
    text["num_hidden_layers"] = depth
    text["layer_types"] = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(depth)]
    if experts is not None:
        text["num_experts"] = experts
        text["num_experts_per_tok"] = min(10, experts)
    if heads is not None:
        text["num_attention_heads"] = heads
    text["mtp_num_hidden_layers"] = PUBLISHED_MTP_LAYERS
    vision = dict(PUBLISHED_VISION, hidden_size=max(64, cut(1152) // 32 * 32), intermediate_size=cut(4304),
                  out_hidden_size=text["hidden_size"])
    return transformers.Qwen3_5MoeConfig(vision_config=vision, text_config=text, image_token_id=248056,
                                         video_token_id=248057, vision_start_token_id=248053,
                                         vision_end_token_id=248054, tie_word_embeddings=False,
                                         architectures=["Qwen3_5MoeForConditionalGeneration"])


def mtp_shapes(cfg) -> dict[str, tuple]:
    """The shapes of a release's multi-token-prediction tensors (``mtp.*``), as Qwen3.5-MoE releases
    ship them: per layer a gated-attention layer with routed and shared experts (one tensor per
    expert), the projection of the concatenated embedding and hidden state, and their norms."""
    text = cfg.text_config
    h, heads, kv, d = text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim
    width, shared = text.moe_intermediate_size, text.shared_expert_intermediate_size
    out = {"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,)}
    for i in range(getattr(text, "mtp_num_hidden_layers", 0) or 0):
        layer = f"mtp.layers.{i}."
        out |= {layer + "input_layernorm.weight": (h,), layer + "post_attention_layernorm.weight": (h,),
                layer + "self_attn.q_proj.weight": (2 * heads * d, h), layer + "self_attn.k_proj.weight": (kv * d, h),
                layer + "self_attn.v_proj.weight": (kv * d, h), layer + "self_attn.o_proj.weight": (h, heads * d),
                layer + "self_attn.q_norm.weight": (d,), layer + "self_attn.k_norm.weight": (d,),
                layer + "mlp.gate.weight": (text.num_experts, h), layer + "mlp.shared_expert_gate.weight": (1, h),
                layer + "mlp.shared_expert.gate_proj.weight": (shared, h),
                layer + "mlp.shared_expert.up_proj.weight": (shared, h),
                layer + "mlp.shared_expert.down_proj.weight": (h, shared)}
        for e in range(text.num_experts):
            expert = f"{layer}mlp.experts.{e}."
            out |= {expert + "gate_proj.weight": (width, h), expert + "up_proj.weight": (width, h),
                    expert + "down_proj.weight": (h, width)}
    return out
