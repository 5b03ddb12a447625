"""Reference side of Kimi-K2.5 whole: transformers' ``Kimi_K25ForConditionalGeneration``, and its
state-dict shapes read off the config from its parts (the ``kimi_k25`` tower and projector, the
``deepseek_v3`` decoder)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Kimi_K25Config

from mmparity.models.parts.deepseek_v3 import reference as decoder
from mmparity.models.kimi_k25 import reference as tower

MODEL_TYPES = ("kimi_k25",)


def tiny_text(**overrides) -> dict:
    """Awkward tiny DeepSeek-V3 sizes: 3 layers (1 dense, then MoE), 6 experts in 3 groups of which
    2 are kept, top-4 (HF's top-2-per-group ranking is then mcore's), one shared expert, a q LoRA
    rank, rope/nope/v head widths 4/6/5, YaRN past its original 12 positions."""
    text = {"model_type": "deepseek_v3", "hidden_size": 40, "num_hidden_layers": 3, "vocab_size": 97,
            "intermediate_size": 36, "moe_intermediate_size": 12, "num_attention_heads": 4,
            "num_key_value_heads": 4, "first_k_dense_replace": 1, "q_lora_rank": 12, "kv_lora_rank": 8,
            "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 5, "n_routed_experts": 6,
            "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 3, "topk_group": 2,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 48,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 12, "beta_fast": 32.0, "beta_slow": 1.0,
                                "mscale": 1.0, "mscale_all_dim": 1.0}}
    return text | overrides


def tiny_config(**text_overrides) -> Kimi_K25Config:
    from transformers import Kimi_K25Config

    vision = tower.tiny_config().vision_config
    return Kimi_K25Config(vision_config=vision, text_config=tiny_text(**text_overrides),
                          projection_hidden_size=vision.hidden_size, tie_word_embeddings=False,
                          image_token_id=95)


def vision_config(cfg):
    """The family config: a whole Kimi-K2.5 config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole Kimi-K2.5 model")


def build(cfg):
    from transformers import Kimi_K25ForConditionalGeneration

    model = Kimi_K25ForConditionalGeneration(cfg).float().eval()
    # HF's own per-expert loop, the definition its kernels (grouped_mm, which on the CPU also
    # refuses bf16 strides that are not multiples of 16 bytes) must reproduce.
    model.set_experts_implementation("eager")
    return model


def state_shapes(cfg) -> dict[str, tuple]:
    text = cfg.text_config
    shapes = {"model." + k: s for k, s in tower.state_shapes(cfg).items()}
    shapes |= {"model.language_model." + k: s for k, s in decoder.decoder_shapes(text).items()}
    shapes["lm_head.weight"] = (text.vocab_size, text.hidden_size)
    return shapes



# Kimi-K2.5's released text config, as recalled (not read from the hub here): the Kimi-K2
# decoder, 1.04T parameters of which 32B are active per token.
PUBLISHED_TEXT = {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840, "intermediate_size": 18432,
                  "moe_intermediate_size": 2048, "num_attention_heads": 64, "num_key_value_heads": 64,
                  "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                  "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1,
                  "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                  "routed_scaling_factor": 2.827, "max_position_embeddings": 262144,
                  "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                                      "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
PUBLISHED_VISION = dict(patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4, num_attention_heads=16,
                        num_hidden_layers=27, hidden_size=1152, intermediate_size=4304,
                        hidden_act="gelu_pytorch_tanh", merge_kernel_size=(2, 2))


def published_config(scale: int = 1, layers: int | None = None, experts: int | None = None,
                     heads: int | None = None) -> Kimi_K25Config:
    """The released Kimi-K2.5 config, or a proportionally scaled one: every width and the expert
    count divided by ``scale`` (heads kept whole), ``layers`` decoder layers and ``experts`` routed
    experts per MoE layer if given (the release's key count at a small width), and ``heads``
    attention heads if given (a scale that does not divide 64 would leave an odd count, which TP 2
    cannot split)."""
    from transformers import Kimi_K25Config, Kimi_K25VisionConfig

    def cut(n: int) -> int:
        # Even, so that TP 2 and EP 2 split every scaled width and the expert count (the powers
        # of two the benchmarks mostly use give even widths anyway; 45 would give 95 and 409).
        return n if scale == 1 else max(2, n // scale // 2 * 2)

    text = dict(PUBLISHED_TEXT)
    for name in ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
                 "vocab_size", "n_routed_experts"):
        text[name] = cut(text[name])
    text["num_attention_heads"] = text["num_key_value_heads"] = max(1, 64 // scale)
    if layers is not None:
        text["num_hidden_layers"] = layers
    if experts is not None:
        text["n_routed_experts"] = experts
    if heads is not None:
        text["num_attention_heads"] = text["num_key_value_heads"] = heads
    # The 2D RoPE layout needs an even head width over the tower's 16 heads: a multiple of 32 (an
    # odd scale such as 8 would leave 144, 9 per head), and 64 (16 heads of 4) at the least.
    vision = dict(PUBLISHED_VISION, hidden_size=max(64, cut(1152) // 32 * 32), intermediate_size=cut(4304))
    return Kimi_K25Config(vision_config=Kimi_K25VisionConfig(**vision), text_config=tiny_text(**text),
                          projection_hidden_size=vision["hidden_size"], tie_word_embeddings=False,
                          image_token_id=text["vocab_size"] - 1)
