"""qwen3_5_lm parity: two rows of seeded text of an odd length, logits at every position and the
per-token loss; paired modules by Megatron's names: each layer's ``self_attention`` (the Gated
DeltaNet or the gated attention), its ``mlp`` (for MoE also ``mlp.router``, with its own
agreement verdict, ``mlp.shared_experts`` and the routed ``mlp.experts``), the layer, the final
norm. Which gated delta rule the native side ran is in each case's description."""

from __future__ import annotations


import torch
import torch.nn.functional as F

from mmparity.models.core import inputs
from mmparity.models.core.inputs import next_tokens
from mmparity.models.core.layers import numbered_layers
from mmparity.models.parts.qwen3_5_text.config import LINEAR, config_problems, is_moe
from mmparity.models.parts.qwen3_5_text.reference import on_own_delta_rule
from mmparity.models.qwen3_5_lm import mapping as converter
from mmparity.models.qwen3_5_lm import native, reference
from mmparity.models.spec import (
    Case, ConfigHooks, FamilyHooks, NoMegatron, Pair, Parity, Side, first_tensor, routing_tensor, sbh_tokens_2d,
    tokens_2d)

OUTPUTS = ("logits", "token_loss")
ROWS, LENGTH = 2, 29  # an odd length, not a multiple of the delta rule's chunk


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    from mmparity.models.parts.qwen3_5_text import delta_rule

    gen = inputs.generator(seed + 4099)
    ids = torch.randint(0, cfg.vocab_size, (ROWS, LENGTH), generator=gen)
    kernel = delta_rule.kernel_for("cpu")
    return [Case("text", {"input_ids": ids}, OUTPUTS,
                 description=f"{ROWS} rows of {LENGTH} tokens; gated delta rule: {kernel} on CPU, "
                             f"{delta_rule.kernel_for('cuda')} on a GPU")]


def _outputs(logits: torch.Tensor, ids: torch.Tensor) -> dict:
    logits = logits.float()
    vocab = logits.shape[-1]
    mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    mask[:, -1] = False  # the last position predicts no token of the row
    loss = F.cross_entropy(logits.reshape(-1, vocab), next_tokens(ids).reshape(-1), reduction="none")
    return {"logits": logits.reshape(-1, vocab), "token_loss": (loss.view(ids.shape) * mask).reshape(-1)}


@on_own_delta_rule
def reference_run(model, case: Case) -> dict:
    ids = case.data["input_ids"].to(next(model.parameters()).device)
    return _outputs(model(input_ids=ids).logits, ids)


def native_run(model, case: Case) -> dict:
    ids = case.data["input_ids"].to(next(model.parameters()).device)
    out = model(ids)
    return _outputs(out, ids) if model.post_process else {}


def _hf_routing(output, case: Case):
    logits, weights, indices = output
    dense = torch.zeros_like(logits, dtype=weights.dtype).scatter(1, indices, weights)
    return routing_tensor(dense, logits.float().softmax(-1))


def _batch_major(t: torch.Tensor, case: Case) -> torch.Tensor:
    batch = case.data["input_ids"].shape[0]
    return t.reshape(-1, batch, t.shape[-1]).transpose(0, 1).reshape(-1, t.shape[-1])


def _mcore_routing(output, case: Case):
    probs, _ = output
    return routing_tensor(_batch_major(probs, case))


def _rows(output, case: Case):
    t = first_tensor(output)
    return t.reshape(-1, t.shape[-1])


def _mcore_rows(output, case: Case):
    return _batch_major(first_tensor(output), case)


LAYER = "language_model.decoder.layers.{}"


def _pairs(layers, cfg, *, hf: bool) -> list[Pair]:
    moe = is_moe(cfg)
    out = []
    for i, layer in layers:
        name = LAYER.format(i)
        if hf:
            mixer = layer.linear_attn if cfg.layer_types[i] == LINEAR else layer.self_attn
            out.append(Pair(name + ".self_attention", mixer, tokens_2d))
            if moe:
                out += [Pair(name + ".mlp.router", layer.mlp.gate, _hf_routing),
                        Pair(name + ".mlp.shared_experts", layer.mlp.shared_expert, tokens_2d),
                        Pair(name + ".mlp.experts", layer.mlp.experts, _rows)]
            out += [Pair(name + ".mlp", layer.mlp, tokens_2d), Pair(name, layer, tokens_2d)]
        else:
            out.append(Pair(name + ".self_attention", layer.self_attention, sbh_tokens_2d, snapshot=True))
            if moe:
                out += [Pair(name + ".mlp.router", layer.mlp.router, _mcore_routing),
                        # before its sigmoid gate, as HF's shared_expert module's output
                        Pair(name + ".mlp.shared_experts", layer.mlp.shared_experts.linear_fc2, _mcore_rows),
                        Pair(name + ".mlp.experts", getattr(layer.mlp, "routed_experts", None), _mcore_rows)]
            out += [Pair(name + ".mlp", layer.mlp, sbh_tokens_2d, snapshot=True), Pair(name, layer, sbh_tokens_2d)]
    return out


FINAL_NORM = "language_model.decoder.final_layernorm"


def reference_language_pairs(text_model, cfg) -> list[Pair]:
    """HF's text model (its ``layers`` and ``norm``): each layer's pairs, then the final norm's."""
    return [*_pairs(enumerate(text_model.layers), cfg, hf=True), Pair(FINAL_NORM, text_model.norm, tokens_2d)]


def native_language_pairs(gpt, cfg) -> list[Pair]:
    """The ``GPTModel`` of this pipeline stage: its layers' pairs, then on the last stage the final
    norm's."""
    decoder = gpt.decoder
    out = _pairs(numbered_layers(decoder), cfg, hf=False)
    if gpt.post_process:
        out.append(Pair(FINAL_NORM, decoder.final_layernorm, sbh_tokens_2d))
    return out


def reference_pairs(model, cfg) -> list[Pair]:
    return reference_language_pairs(model.model, cfg)


def native_pairs(model, cfg) -> list[Pair]:
    return native_language_pairs(model.language_model, cfg)


def no_component(name, model, cfg, seed):
    raise KeyError(name)


def random_text_options(pick) -> dict:
    """``tiny_config`` arguments of a random text model: dense or MoE, 2 to 4 layers of both
    kinds, odd Gated DeltaNet value widths."""
    kinds = ["linear_attention", "full_attention"]
    layers = pick([2, 3, 4])
    types = [kinds[0], kinds[1]] + [pick(kinds) for _ in range(layers - 2)]
    return dict(moe=pick([True, False]), num_hidden_layers=layers, layer_types=types,
                linear_num_value_heads=pick([2, 4]), linear_value_head_dim=pick([6, 10]))


def random_config(pick):
    return reference.tiny_config(**random_text_options(pick))


# What the refusal names: megatron-core's constructor checks for fla, and its forward calls fla's
# l2norm on q/k whatever the mode (deterministic_mode swaps only the delta rule for its torch one);
# fla's kernels are triton, which has no CPU driver. mmparity does not patch megatron-core to get
# past either; its native model holds the same layout and runs the rule in torch.
MEGATRON = NoMegatron("megatron-core's GatedDeltaNet needs fla (pip install flash-linear-attention) to be built, "
                      "and its forward runs fla's triton kernels (the q/k l2norm even in deterministic mode), "
                      "which need a GPU; the native model holds its exact layout and runs the rule in torch")


def _build_problems() -> list[str]:
    """megatron-core 0.16 builds its ``GatedDeltaNet`` on any machine (the forward here is our own);
    later releases (the ``ssm/gated_delta_net/`` package) build it only with fla installed and set
    the kernel up in the constructor, so the native model cannot be made there without fla."""
    import importlib.util
    import os

    import megatron.core.ssm as ssm

    package = os.path.isdir(os.path.join(os.path.dirname(ssm.__file__), "gated_delta_net"))
    if package and importlib.util.find_spec("fla") is None:
        return ["this megatron-core builds its GatedDeltaNet only with fla installed (pip install "
                "flash-linear-attention), which this machine lacks; megatron-core 0.16 builds it without"]
    return []


def _problems(cfg) -> list[str]:
    return config_problems(cfg) + _build_problems()


def hooks(towers, languages) -> FamilyHooks:
    def build_native(cfg, params_dtype=torch.float32):
        return native.build_native(cfg, params_dtype, language=languages(_as_whole(cfg)).native)

    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=_problems),
        reference=Side(reference_run, reference_pairs, no_component, reference.build),
        native=Side(native_run, native_pairs, no_component, build_native), converter=converter.SPEC,
        parity=Parity(cases), megatron=MEGATRON)


class _Whole:
    """The registry finds a language-model part by ``text_config.model_type``."""

    def __init__(self, text):
        self.text_config = text


def _as_whole(cfg):
    return _Whole(cfg)


