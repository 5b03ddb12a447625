"""Qwen3-VL-MoE whole parity: Qwen3-VL whole's cases (two rows of text with three images of
different sizes between vision start / end tokens; then a short clip, its temporal patches apart
after timestamp text, beside images; logits at every position and the per-token loss) and its
runs, which take either model; the pairs are Qwen3-VL whole's, plus inside each MoE
layer's MLP its router (judged by router agreement) and the routed experts' combined output, so
that a fault is named by the part of the layer it is in.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from mmparity.models.core import sublayers
from mmparity.models.core.layers import numbered_layers
from mmparity.models.qwen3_vl import cases as tower_cases
from mmparity.models.qwen3_vl_moe import mapping as converter
from mmparity.models.qwen3_vl_moe.config import dense_tower
from mmparity.models.qwen3_vl_moe import native, reference
from mmparity.models.qwen3_vl_moe.megatron import MEGATRON
from mmparity.models.qwen3_vl_whole import cases as whole
from mmparity.models.spec import (
    Case, ConfigHooks, FamilyHooks, Pair, Parity, Side, routing_tensor, sbh_tokens_2d, tokens_2d)


# --- the pairs inside an MoE layer's MLP ------------------------------------------------------------

def reference_mlp_pairs(name: str, mlp, extract) -> list[Pair]:
    """HF's sparse block: its router (the dense routing weights and the softmax scores the choice
    was made on) and its experts' combined output (batch-major flattened tokens); none in a dense
    layer."""
    if not (hasattr(mlp, "gate") and hasattr(mlp, "experts")):
        return []
    return [Pair(name + ".router", mlp.gate, _hf_routing), Pair(name + ".experts", mlp.experts, extract)]


def _hf_routing(output, case: Case):
    logits, weights, indices = output
    dense = logits.new_zeros(logits.shape, dtype=weights.dtype).scatter(1, indices, weights)
    return routing_tensor(dense, logits.float().softmax(-1))


def native_mlp_pairs(name: str, mlp, extract) -> list[Pair]:
    """mcore's ``MoELayer``: the DeepSeek-V3 part's router and routed-experts pairs (it has no
    shared expert to pair here). With no shared output added to it, the routed experts' output is
    the MLP's own, into which the layer's bias-dropout-add adds the residual in place: copied when
    produced."""
    from mmparity.models.parts.deepseek_v3.native import mlp_pairs

    pairs = [p for p in mlp_pairs(name, mlp, extract) if not p.name.endswith(".shared_experts")]
    return [replace(p, snapshot=True) if p.name.endswith(".experts") else p for p in pairs]


def language_pairs(layers, *, hf: bool) -> list[Pair]:
    """Each decoder layer's norms, attention, router, experts and MLP, then the layer (a snapshot on
    the mcore side, where the next layer's residual add would change its output in place)."""
    out = []
    for i, layer in layers:
        name = whole.LANGUAGE_LAYER.format(i)
        if hf:
            out += sublayers.layer_pairs(name, layer, tokens_2d, sublayers.HF_DECODER,
                                         inner=partial(reference_mlp_pairs, extract=tokens_2d))
        else:
            pairs = sublayers.layer_pairs(name, layer, sbh_tokens_2d,
                                          inner=partial(native_mlp_pairs, extract=sbh_tokens_2d))
            out += pairs[:-1] + [Pair(name, layer, sbh_tokens_2d, snapshot=True)]
    return out


def reference_pairs(model, cfg) -> list[Pair]:
    out = [p.under("vision_model.")
           for p in tower_cases.reference_pairs(model.model.visual, cfg.vision_config)]
    out += language_pairs(enumerate(model.model.language_model.layers), hf=True)
    out.append(Pair("language_model.decoder.final_layernorm", model.model.language_model.norm, tokens_2d))
    return out


def native_pairs(model, cfg) -> list[Pair]:
    out = []
    if model.vision_model is not None:
        out += [p.under("vision_model.")
                for p in tower_cases.native_pairs(model.vision_model, cfg.vision_config)]
    out += language_pairs(numbered_layers(model.language_model.decoder), hf=False)
    if model.post_process:
        out.append(Pair("language_model.decoder.final_layernorm", model.language_model.decoder.final_layernorm,
                        sbh_tokens_2d))
    return out


def random_config(pick):
    heads = pick([2, 4])
    groups = pick([g for g in (1, 2) if heads % g == 0])
    head_dim = pick([8, 12])
    half = head_dim // 2
    h_sec = pick([1, 2])
    layers = pick([2, 3])
    count = pick([4, 8])
    return reference.tiny_config(
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
        hidden_size=pick([24, 40]), num_hidden_layers=layers, num_experts=count,
        num_experts_per_tok=pick([1, 2, 3]), moe_intermediate_size=pick([6, 14]),
        mlp_only_layers=pick([[], [layers - 1]]), decoder_sparse_step=pick([1, 2]),
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                         "mrope_section": [half - 2 * h_sec, h_sec, h_sec], "mrope_interleaved": True})


def config_problems(cfg) -> list[str]:
    problems = [f"text_config: {p}" for p in native.text_config_problems(cfg.text_config)]
    return problems + tower_cases.config_problems(dense_tower(cfg.vision_config))


def hooks(towers, languages) -> FamilyHooks:
    """The decoder is this package's own (no registered part takes Qwen3-VL-MoE's text model)."""
    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=config_problems, image_size_multiple=whole.image_size_multiple,
                           image_size_problems=whole.image_size_problems, pipeline_problems=whole.pipeline_problems),
        reference=Side(whole.reference_run, reference_pairs, whole.no_component, reference.build),
        native=Side(whole.native_run, native_pairs, whole.no_component, native.build_native),
        converter=converter.SPEC, parity=Parity(partial(whole.cases, video=whole.FRAMES_APART)),
        megatron=MEGATRON)
