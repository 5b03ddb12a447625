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
def config_and_tp(draw, configs, heads_attr="num_attention_heads"):
    cfg = draw(configs)
    heads = getattr(cfg, heads_attr)
    tps = [d for d in divisors(heads) if cfg.intermediate_size % d == 0]
    return cfg, draw(st.sampled_from(tps))


# family name -> strategy of HF configs (families add theirs here)
CONFIGS = {
    "pixtral": pixtral_configs(),
}
