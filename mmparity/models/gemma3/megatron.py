"""Megatron's own class for Gemma 3's language model: stock megatron-core ``GPTModel`` on
:data:`LAYER`, megatron-core's TE GPT layer spec (q/k norms) whose two row-parallel linears carry
Gemma's sandwich norms (``linear_proj.post_layernorm``, ``linear_fc2.post_layernorm``, the names
Megatron-Bridge gives them, which the converter writes), as Megatron-LM's ``pretrain_gpt.py`` builds
it with ``--spec mmparity.models.gemma3.megatron LAYER`` and the Gemma flags (docs/megatron.md;
:class:`Gemma3Layer` takes what no flag says from the HF config beside ``--load``): every norm
``1 + w`` (``layernorm_zero_centered_gamma``), GeGLU (tanh), the attention scale
``query_pre_attn_scalar ** -0.5`` (``softmax_scale``), sliding-window layers by ``window_size`` /
``window_attn_skip_freq``, a tied head.

What the class computes differently from HF, by design (megatron-core 0.16 has no module for
either): its embedding is not scaled by ``sqrt(hidden)``, and every layer rotates with one RoPE
(the full layers' base and linear factor) where HF's sliding layers have a base of their own. The
reference it is compared with is HF's text model run the same way (:func:`_reference_language_model`):
the unscaled table looked up as ``inputs_embeds``, the sliding layers handed the full layers' RoPE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import gpt_model
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from mmparity.config import padded_vocab_size, tied_embeddings
from mmparity.io.fsio.errors import CheckpointError
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core import spec_beside, te_stand_ins
from mmparity.models.core.te_stand_ins import buildable_without_te, te_class
from mmparity.models.gemma3.config import (
    FULL, HF_CONFIGS, layer_rope, text_problems, transformer_config, window_args)
from mmparity.models.llava import megatron as llava
from mmparity.models.parts.gemma_blocks import post_normed
from mmparity.models.spec import Case
from mmparity.parallel import runtime

PostNormedTERowParallelLinear = post_normed(te_class("TERowParallelLinear"), te_class("TENorm"))


def with_submodules(spec, **changes):
    """``spec`` with some of its submodules replaced: a ``ModuleSpec``, or the ``functools.partial``
    newer megatron-core spells an MLP's spec with (``submodules`` among its keywords)."""
    if isinstance(spec, functools.partial):
        keywords = {**spec.keywords, "submodules": dataclasses.replace(spec.keywords["submodules"], **changes)}
        return functools.partial(spec.func, *spec.args, **keywords)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


def _layer_spec() -> ModuleSpec:
    from megatron.core.models.gpt import gpt_layer_specs
    with te_stand_ins.qk_norm_without_te():
        spec = te_stand_ins.megatron_te_spec(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec,
                                             qk_layernorm=True)
    layer = spec.submodules
    return with_submodules(
        spec, self_attention=with_submodules(layer.self_attention, linear_proj=PostNormedTERowParallelLinear),
        mlp=with_submodules(layer.mlp, linear_fc2=PostNormedTERowParallelLinear))


# The layer every decoder layer is built on (the sliding ones are the config's
# ``window_attn_skip_freq``): what the class is built with, and what :data:`LAYER` builds.
LAYER_SPEC = _layer_spec()
SPEC = (f"{__package__}.megatron", "LAYER")
NEEDS = "Gemma 3's tanh GeGLU and attention scale"
# The text config alone: a whole release's file is read through its ``text_config``.
TEXT_TABLES = {"gemma3_text": HF_CONFIGS["gemma3_text"]}


@functools.lru_cache(maxsize=4)
def text_config_beside(root: str):
    """The Gemma 3 text config of the ``hf_config.json`` mmparity keeps at a checkpoint's root
    (:func:`~mmparity.models.core.spec_beside.read_text_config`), what the class cannot build
    refused, and that file's path."""
    text, path = spec_beside.read_text_config(root, spec=SPEC, model="Gemma 3", tables=TEXT_TABLES, needs=NEEDS)
    problems = text_problems(text)
    if problems:
        raise CheckpointError(f"{path}: unsupported Gemma 3 language model: " + "; ".join(problems))
    return text, path


class Gemma3Layer(TransformerLayer):
    """Not a layer class of its own: building it builds :data:`LAYER_SPEC`'s layer with the config
    Megatron-LM's flags give, completed from the HF text config beside the run's checkpoint
    (``args.load``): its flags have no tanh GeGLU (``--swiglu`` is SiLU's) and no
    ``softmax_scale`` (``query_pre_attn_scalar ** -0.5``), so without this the layer would hold
    Gemma's tensors and compute another function. What the flags do say is checked against the
    file, one line naming the flag."""

    def __new__(cls, config, submodules=None, layer_number: int = 1, pg_collection=None, vp_stage=None,
                **kwargs):
        text, path = text_config_beside(spec_beside.run_root(SPEC, NEEDS))
        want = megatron_config(text, config.params_dtype)
        return build_module(LAYER_SPEC, config=spec_beside.checked_run_config(config, want, path, SPEC),
                            layer_number=layer_number, pg_collection=pg_collection, vp_stage=vp_stage, **kwargs)


# What Megatron-LM's ``--spec mmparity.models.gemma3.megatron LAYER`` imports.
LAYER = ModuleSpec(module=Gemma3Layer)


def megatron_config(text, params_dtype=torch.float32):
    """The family's one recipe (:func:`mmparity.models.gemma3.config.transformer_config`) with the
    sliding layers as megatron-core says them (:func:`~mmparity.models.gemma3.config.window_args`,
    what ``convert`` records)."""
    return dataclasses.replace(transformer_config(text, params_dtype), **window_args(text))


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True, *, layer: ModuleSpec | None = None,
                         config: TransformerConfig | None = None):
    """Stock ``GPTModel`` on :data:`LAYER_SPEC` for a whole Gemma 3's text model, one RoPE (the full
    layers' base, their linear factor as megatron-core's position interpolation); this pipeline
    stage of it. ``layer`` / ``config``: what Megatron-LM's ``gpt_builder`` hands ``GPTModel`` in
    their place (``--spec``'s :data:`LAYER`, the config of its flags), to build that path without
    Megatron-LM."""
    text = cfg.text_config
    layout = runtime.current_layout()
    tp = layout.tp if layout is not None else 1
    base, factor = layer_rope(text, FULL)
    with buildable_without_te(gpt_model, transformer_block):
        model = gpt_model.GPTModel(
            config=config or megatron_config(text, params_dtype), transformer_layer_spec=layer or LAYER_SPEC,
            vocab_size=padded_vocab_size(text.vocab_size, divisible_by, tp),
            max_sequence_length=text.max_position_embeddings,
            pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
            parallel_output=parallel_output, share_embeddings_and_output_weights=tied_embeddings(cfg),
            position_embedding_type="rope", rotary_base=base,
            seq_len_interpolation_factor=factor if factor != 1.0 else None,
            scatter_embedding_sequence_parallel=False)
    return model.eval()


@contextlib.contextmanager
def _one_rope(text_model):
    """HF's text model with every layer type handed the full layers' RoPE."""
    rotary = text_model.rotary_emb
    full = rotary.forward
    rotary.forward = lambda x, position_ids, layer_type=None: full(x, position_ids, FULL)
    try:
        yield
    finally:
        del rotary.forward


def _reference_language_model(model, case: Case, cfg) -> dict:
    """HF's text model and tied head on the ids as the class computes them: the embedding table
    looked up unscaled, one RoPE for every layer."""
    text_model = model.model.language_model
    ids = case.data["input_ids"].to(next(model.parameters()).device)
    with _one_rope(text_model):
        hidden = text_model(inputs_embeds=F.embedding(ids, text_model.embed_tokens.weight)).last_hidden_state
    logits = model.lm_head(hidden).float()
    return {"logits": logits.reshape(-1, logits.shape[-1]), "loss_mask": case.data["loss_mask"].reshape(-1)}


WHY_NO_WHOLE = ("megatron-core's LLaVAModel has no place for Gemma 3's average-pool projector nor its images' "
                "bidirectional attention, so only the language model has one: stock GPTModel, which trains it alone")

LANGUAGE_MODEL = dataclasses.replace(
    llava.LANGUAGE_MODEL, build=build_language_model, reference_run=_reference_language_model,
    why_part=WHY_NO_WHOLE, unwritten_extra_state=(),
    note="the Gemma 3 language model part (language_model.*) on text-only ids, stock GPTModel on megatron-core's TE "
         "spec with the sandwich norms on linear_proj / linear_fc2 (zero-centred norms, sliding windows, "
         "query_pre_attn_scalar); against HF run as the class computes by design: the embedding unscaled (no "
         "sqrt(hidden) in GPTModel) and the sliding layers on the full layers' RoPE (GPTModel has one); "
         f"{llava.PADDED_LOSS_NOTE}")
MEGATRON = {"GPTModel": LANGUAGE_MODEL}
