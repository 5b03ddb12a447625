"""GLM-4.5V whole parity: Qwen-VL whole's batch (two rows of text with three images of different
sizes, each between GLM's image start / end tokens, one image token per merged patch) and its
runs, which take either model; logits at every position and the per-token loss. The pairs are
named by Megatron's tree: the tower's (``vision_model.layer.N.…``, ``vision_model.merger.…``),
then per decoder layer its norms, attention and MLP, inside an MoE layer's MLP its router (judged
by router agreement), shared experts and routed experts' combined output (the DeepSeek-V3 part's
pairs), then the layer, and the final norm.
"""

from __future__ import annotations

from functools import partial

from mmparity.models.core import sublayers
from mmparity.models.glm4v_moe import mapping as converter
from mmparity.models.glm4v_moe import native, reference
from mmparity.models.glm4v_moe.megatron import MEGATRON
from mmparity.models.glm4v_vision import cases as tower_cases
from mmparity.models.parts.deepseek_v3 import native as moe_native
from mmparity.models.parts.deepseek_v3 import reference as moe_reference
from mmparity.models.qwen3_vl_whole import cases as whole
from mmparity.models.spec import ConfigHooks, FamilyHooks, Pair, Parity, Side, sbh_tokens_2d, tokens_2d


class _ImageTokens:
    """The whole config as Qwen-VL whole's cases read it: GLM's image start / end tokens are the
    vision start / end tokens around each image's run."""

    def __init__(self, cfg):
        self._cfg = cfg
        self.vision_start_token_id = cfg.image_start_token_id
        self.vision_end_token_id = cfg.image_end_token_id

    def __getattr__(self, name):
        return getattr(self._cfg, name)


def cases(cfg, seed: int, image_sizes=None):
    return whole.cases(_ImageTokens(cfg), seed, image_sizes)


def language_pairs(layers, *, hf: bool) -> list[Pair]:
    """Each decoder layer's norms, attention, MLP (with the MoE's inner pairs), then the layer (a
    snapshot on the mcore side, where the next layer's residual add would change it in place)."""
    extract = tokens_2d if hf else sbh_tokens_2d
    inner = partial((moe_reference if hf else moe_native).mlp_pairs, extract=extract)
    out = []
    for i, layer in layers:
        name = whole.LANGUAGE_LAYER.format(i)
        pairs = sublayers.layer_pairs(name, layer, extract, sublayers.HF_DECODER if hf else None, inner=inner)
        out += pairs if hf else pairs[:-1] + [Pair(name, layer, extract, snapshot=True)]
    return out


# The tower's pairs and the layers' above, in Qwen-VL whole's order.
reference_pairs = partial(whole.reference_pairs, tower_pairs=tower_cases.reference_pairs, layer_pairs=language_pairs)
native_pairs = partial(whole.native_pairs, tower_pairs=tower_cases.native_pairs, layer_pairs=language_pairs)


def random_config(pick, tiny=reference.tiny_config):
    heads = pick([2, 4])
    groups = pick([g for g in (1, 2) if heads % g == 0])
    head_dim = pick([8, 16])
    half = head_dim // 4  # half of each head rotated
    h_sec = pick(range(0, half))
    count, n_group = pick([(4, 2), (8, 2), (8, 4), (4, 1)])
    top_group = pick([g for g in range(1, n_group + 1) if 2 * g <= count])
    return tiny(
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
        hidden_size=pick([24, 40]), num_hidden_layers=pick([2, 3]), first_k_dense_replace=pick([0, 1]),
        n_routed_experts=count, n_group=n_group, topk_group=top_group, num_experts_per_tok=2 * top_group,
        routed_scaling_factor=pick([1.0, 2.5]), n_shared_experts=pick([1, 2]),
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [half - h_sec, h_sec, 0]})


def config_problems(cfg) -> list[str]:
    return [f"text_config: {p}" for p in native.text_config_problems(cfg.text_config)]


def hooks(towers, languages) -> FamilyHooks:
    """The tower and the decoder are composed here (no registered part takes GLM's decoder)."""
    return family_hooks(reference, config_problems)


def family_hooks(ref, problems) -> FamilyHooks:
    """This family's record over the reference module ``ref`` (its tiny config, family config and
    HF class) and ``problems``: GLM-4.6V's class shares everything else."""
    return FamilyHooks(
        config=ConfigHooks(tiny=ref.tiny_config, family_config=ref.vision_config,
                           random=partial(random_config, tiny=ref.tiny_config),
                           problems=problems, image_size_multiple=whole.image_size_multiple,
                           image_size_problems=whole.image_size_problems),
        reference=Side(whole.reference_run, reference_pairs, whole.no_component, ref.build),
        native=Side(whole.native_run, native_pairs, whole.no_component, native.build_native),
        converter=converter.SPEC, parity=Parity(cases), megatron=MEGATRON)
