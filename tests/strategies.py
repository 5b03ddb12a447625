"""All hypothesis strategies of the test suite."""

from __future__ import annotations

from hypothesis import strategies as st


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def pixtral_configs(draw):
    from transformers import PixtralVisionConfig

    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    head_dim = draw(st.sampled_from([4, 8, 12, 20]))
    return PixtralVisionConfig(hidden_size=heads * head_dim,
                               intermediate_size=draw(st.integers(1, 9)) * 12,
                               num_hidden_layers=draw(st.integers(1, 3)),
                               num_attention_heads=heads, image_size=64, patch_size=8,
                               hidden_act="silu")


@st.composite
def qwen3_5_configs(draw):
    from transformers import Qwen3_5MoeVisionConfig

    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    side = draw(st.integers(1, 6))
    return Qwen3_5MoeVisionConfig(
        depth=draw(st.integers(1, 2)), hidden_size=heads * head_dim, num_heads=heads,
        intermediate_size=draw(st.integers(1, 4)) * 12, in_channels=draw(st.sampled_from([1, 3])),
        patch_size=draw(st.sampled_from([2, 3])), temporal_patch_size=draw(st.sampled_from([1, 2])),
        spatial_merge_size=draw(st.sampled_from([1, 2])), out_hidden_size=draw(st.integers(3, 20)),
        num_position_embeddings=side * side)


@st.composite
def clip_configs(draw):
    from transformers import CLIPVisionConfig

    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    patch = draw(st.sampled_from([4, 8]))
    return CLIPVisionConfig(hidden_size=heads * head_dim,
                            intermediate_size=draw(st.integers(1, 7)) * 12,
                            num_hidden_layers=draw(st.integers(1, 3)), num_attention_heads=heads,
                            image_size=patch * draw(st.integers(2, 5)), patch_size=patch,
                            hidden_act=draw(st.sampled_from(["quick_gelu", "gelu"])))


@st.composite
def siglip_configs(draw):
    from transformers import SiglipVisionConfig

    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    patch = draw(st.sampled_from([4, 8]))
    return SiglipVisionConfig(hidden_size=heads * head_dim,
                              intermediate_size=draw(st.integers(1, 7)) * 12,
                              num_hidden_layers=draw(st.integers(1, 3)), num_attention_heads=heads,
                              image_size=patch * draw(st.integers(2, 5)), patch_size=patch,
                              vision_use_head=draw(st.booleans()))


@st.composite
def mistral3_configs(draw):
    from transformers import PixtralVisionConfig, MistralConfig, Mistral3Config

    heads = draw(st.sampled_from([1, 2, 4, 6]))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    vision = PixtralVisionConfig(hidden_size=heads * head_dim,
                                 intermediate_size=draw(st.integers(1, 6)) * 12,
                                 num_hidden_layers=draw(st.integers(1, 2)),
                                 num_attention_heads=heads, image_size=64, patch_size=8,
                                 hidden_act="silu")
    text = MistralConfig(hidden_size=draw(st.sampled_from([8, 12, 24, 40])), intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=4, vocab_size=16, rms_norm_eps=1e-5)
    return Mistral3Config(vision_config=vision, text_config=text,
                          spatial_merge_size=draw(st.sampled_from([1, 2, 3])),
                          multimodal_projector_bias=draw(st.booleans()))


def _kimi_text_config(hidden: int) -> dict:
    return {"model_type": "deepseek_v3", "hidden_size": hidden, "num_hidden_layers": 1,
            "vocab_size": 32, "intermediate_size": 16, "moe_intermediate_size": 8,
            "num_attention_heads": 2, "num_key_value_heads": 2, "first_k_dense_replace": 1,
            "q_lora_rank": None, "kv_lora_rank": 4, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
            "v_head_dim": 4, "n_routed_experts": 2, "num_experts_per_tok": 1}


@st.composite
def kimi_configs(draw):
    """Random tower shapes; a whole config (with projector) or a vision config."""
    from transformers import Kimi_K25Config, Kimi_K25VisionConfig

    heads = draw(st.sampled_from([1, 2, 4, 6]))
    hidden = heads * draw(st.sampled_from([4, 8, 12]))
    table = draw(st.integers(2, 5))
    vision = Kimi_K25VisionConfig(
        patch_size=draw(st.sampled_from([2, 3])), pos_emb_height=table, pos_emb_width=table,
        pos_emb_time=draw(st.integers(1, 4)), num_attention_heads=heads,
        num_hidden_layers=draw(st.integers(1, 2)), hidden_size=hidden,
        intermediate_size=draw(st.integers(1, 6)) * 4)
    if draw(st.booleans()):
        return vision
    return Kimi_K25Config(vision_config=vision, text_config=_kimi_text_config(draw(st.sampled_from([8, 20]))),
                          projection_hidden_size=hidden, tie_word_embeddings=False)


@st.composite
def config_and_tp(draw, family, configs):
    """A config and a TP size that the family's own converter accepts for it."""
    from mmparity import converters

    cfg = draw(configs)
    validate = converters.rule_set_for(family, cfg).validate_tp
    tps = [t for t in range(1, 9) if not (validate and validate(t))]
    return cfg, draw(st.sampled_from(tps))


# family name -> strategy of HF configs (families add theirs here)
CONFIGS = {
    "pixtral": pixtral_configs(),
    "qwen3_5": qwen3_5_configs(),
    "pixtral_large": mistral3_configs(),
    "siglip": siglip_configs(),
    "clip": clip_configs(),
    "kimi_k25": kimi_configs(),
}
