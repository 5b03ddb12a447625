"""Megatron's own class for Gemma 4's language model: stock megatron-core ``GPTModel`` on
:func:`layer_spec`, Gemma 3's Megatron layer (megatron-core's TE GPT layer spec, q/k norms, the
sandwich norms on ``linear_proj`` / ``linear_fc2``: :mod:`mmparity.models.gemma3.megatron`) with
Gemma 4's flags: every norm ``w`` (no ``layernorm_zero_centered_gamma``), attention unscaled
(``softmax_scale`` 1), sliding-window layers by ``window_size`` / ``window_attn_skip_freq``, a tied
head.

What megatron-core has no place for, each the smallest module that holds it:

* the full layers' own head width (``global_head_dim``) and key/value heads: megatron-core's
  ``TransformerConfig`` has one ``kv_channels`` (its heterogeneous config varies the query groups
  per block, not the width), so the attention reads a per-layer config
  (:class:`~mmparity.models.parts.gemma_blocks.PerLayerRopeSelfAttention`, the stock
  ``SelfAttention`` built from the block's config with that layer's fields replaced; its state
  dict is the stock one);
* each layer's RoPE (sliding: default, full: proportional over the wider heads): ``GPTModel``
  hands every layer one table of one width, so the same attention rotates with its own layer's;
* HF's weightless value norm: TE's attention with each value head RMS-normalised first
  (:class:`ValueNormedDotProductAttention`, no state);
* ``layer_scalar``: the stock layer whose output is multiplied by it, a buffer of the layer
  (:class:`~mmparity.models.parts.gemma4_text.native.ScaledLayer`), as the converter writes it;
* the MoE block (``enable_moe_block``): megatron-core's ``MoELayer`` with the TE spec's
  ``TEGroupedMLP`` experts and the layer's dense MLP as its shared expert, plus Gemma's router
  scales and the experts' norms (:mod:`~mmparity.models.parts.gemma4_text.moe_native`).

Megatron-LM's ``pretrain_gpt.py`` builds it with ``--spec mmparity.models.gemma4.megatron LAYER``
(:class:`Gemma4Layer`): what its flags cannot say (each layer's width, key/value heads and RoPE, the
tanh GeGLU, ``softmax_scale`` 1, the block keyed layer by layer in torch_dist) is read from the HF
config ``mmparity convert`` keeps beside the checkpoint the run loads (``--load``), and what they
can say is checked against it.

What the class computes differently from HF, by design (``GPTModel`` has neither): its embedding
is not scaled by ``sqrt(hidden)`` and its logits are not soft-capped. The reference it is
compared with is HF's text model run that way (:func:`_reference_language_model`): the unscaled
table looked up as ``inputs_embeds``, the head's logits uncapped.
"""

from __future__ import annotations

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
from mmparity.models.gemma3 import megatron as gemma3
from mmparity.models.llava import megatron as llava
from mmparity.models.parts.gemma4_text.config import (
    HF_CONFIGS, SLIDING, config_problems, layer_fields, layer_inv_freq, transformer_config)
from mmparity.models.parts.gemma4_text import per_layer
from mmparity.models.parts.gemma4_text.moe import is_moe
from mmparity.models.parts.gemma4_text.moe_native import moe_layer_spec, spec_submodules
from mmparity.models.parts.gemma4_text.native import ScaledLayer, rms_norm
from mmparity.models.parts.gemma_blocks import PerLayerRopeSelfAttention
from mmparity.models.spec import Case
from mmparity.parallel import runtime


class ValueNormedDotProductAttention(te_class("TEDotProductAttention")):
    """TE's attention (megatron-core's spec's) on values RMS-normalised per head with no weight,
    HF's ``v_norm``: megatron-core has no value norm, and there is nothing to hold."""

    def forward(self, query, key, value, *args, **kwargs):
        return super().forward(query, key, rms_norm(value, None, self.config.layernorm_epsilon), *args, **kwargs)


def layer_spec(text) -> ModuleSpec:
    """Gemma 3's Megatron layer spec with Gemma 4's three additions (module note): the layer scaled,
    the attention reading its own layer's width, groups and RoPE, the values normed."""
    base = gemma3.LAYER_SPEC
    attention = base.submodules.self_attention
    ropes = tuple(layer_inv_freq(text, i) for i in range(text.num_hidden_layers))
    attention = dataclasses.replace(
        gemma3.with_submodules(attention, core_attention=ValueNormedDotProductAttention),
        module=PerLayerRopeSelfAttention,
        params={**attention.params, "ropes": ropes, "layer_fields": layer_fields(text)})
    layer = dataclasses.replace(gemma3.with_submodules(base, self_attention=attention), module=ScaledLayer)
    return _with_moe_block(text, layer) if is_moe(text) else layer


def _with_moe_block(text, layer: ModuleSpec) -> ModuleSpec:
    """``layer`` with the MoE block as its MLP (:func:`~mmparity.models.parts.gemma4_text.moe_native.moe_layer_spec`):
    megatron-core's TE spec's routed experts (``TEGroupedMLP``, grouped GEMMs), the layer's own
    dense MLP as the shared expert, Gemma's router, TE's norm for the experts' and the block's norms."""
    from megatron.core.models.gpt import gpt_layer_specs

    with te_stand_ins.qk_norm_without_te():
        te = te_stand_ins.megatron_te_spec(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec,
                                           num_experts=text.num_experts, moe_grouped_gemm=True, qk_layernorm=True)
    return moe_layer_spec(layer, te_class("TENorm"), rms_norm, experts=spec_submodules(te.submodules.mlp).experts)


def megatron_config(text, params_dtype=torch.float32):
    """The part's one recipe (:func:`mmparity.models.parts.gemma4_text.config.transformer_config`)
    with the sliding layers as megatron-core says them (Gemma 3's: ``sliding_window - 1`` keys
    back, on the layers listed 1 in ``window_attn_skip_freq``)."""
    sliding = [int(kind == SLIDING) for kind in text.layer_types]
    extra = dict(window_size=(text.sliding_window - 1, 0), window_attn_skip_freq=sliding) if any(sliding) else {}
    if is_moe(text):  # the experts as grouped GEMMs, as Megatron-LM's MoE recipes run them
        extra["moe_grouped_gemm"] = True
    return dataclasses.replace(transformer_config(text, params_dtype), **extra)


SPEC = ("mmparity.models.gemma4.megatron", "LAYER")
NEEDS = "Gemma 4's per-layer widths and RoPE"


@functools.lru_cache(maxsize=4)
def text_config_beside(root: str):
    """The Gemma 4 text config of the ``hf_config.json`` mmparity keeps at a checkpoint's root
    (:func:`~mmparity.models.core.spec_beside.read_text_config`), what the class cannot build
    refused, and that file's path."""
    text, path = spec_beside.read_text_config(root, spec=SPEC, model="Gemma 4", tables=HF_CONFIGS, needs=NEEDS)
    problems = config_problems(text) + [why for why in [per_layer.megatron_refusal(text)] if why]
    if problems:
        raise CheckpointError(f"{path}: unsupported Gemma 4 language model: " + "; ".join(problems))
    return text, path


def run_layer_config(config, text, where) -> TransformerConfig:
    """The layer's config from the run's (Megatron-LM's flags), checked against and completed from
    :func:`megatron_config` of the HF text config."""
    return spec_beside.checked_run_config(config, megatron_config(text, config.params_dtype), where, SPEC)


class Gemma4Layer(TransformerLayer):
    """Not a layer class of its own: building it builds :func:`layer_spec`'s layer (a
    :class:`ScaledLayer`) for the HF text config beside the run's checkpoint. A ``ModuleSpec``
    imported by ``--spec`` is built without any model fact past Megatron-LM's flags, which have
    no per-layer width, key/value heads or RoPE; this reads them when the block builds the layer,
    from the file Megatron-LM's own ``args.load`` names (no environment variable: what launched the
    run cannot leak into the model).

    The block keys its layers one by one in torch_dist (their tensors differ in width), a field of
    the block's config that no flag sets: set here on the config the block hands every layer, which
    is the block's own."""

    def __new__(cls, config, submodules=None, layer_number: int = 1, pg_collection=None, vp_stage=None,
                **kwargs):
        text, path = text_config_beside(spec_beside.run_root(SPEC, NEEDS))
        layer_config = run_layer_config(config, text, path)
        config.hetereogenous_dist_checkpoint = True
        return build_module(layer_spec(text), config=layer_config, layer_number=layer_number,
                            pg_collection=pg_collection, vp_stage=vp_stage, **kwargs)


# What Megatron-LM's ``--spec mmparity.models.gemma4.megatron LAYER`` imports.
LAYER = ModuleSpec(module=Gemma4Layer)


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True, *, layer: ModuleSpec | None = None,
                         config: TransformerConfig | None = None):
    """Stock ``GPTModel`` on :func:`layer_spec` for a whole Gemma 4's text model; this pipeline
    stage of it. No position embedding of the model's own: each layer's attention rotates.
    ``layer`` / ``config``: what Megatron-LM's ``gpt_builder`` hands ``GPTModel`` in their place
    (``--spec``'s :data:`LAYER`, the config of its flags), to build that path without Megatron-LM."""
    text = cfg.text_config
    problems = config_problems(text) + [why for why in [per_layer.megatron_refusal(text)] if why]
    if problems:
        raise ValueError("unsupported Gemma 4 language model: " + "; ".join(problems))
    layout = runtime.current_layout()
    tp = layout.tp if layout is not None else 1
    with buildable_without_te(gpt_model, transformer_block):
        model = gpt_model.GPTModel(
            config=config or megatron_config(text, params_dtype), transformer_layer_spec=layer or layer_spec(text),
            vocab_size=padded_vocab_size(text.vocab_size, divisible_by, tp),
            max_sequence_length=text.max_position_embeddings,
            pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
            parallel_output=parallel_output, share_embeddings_and_output_weights=tied_embeddings(cfg),
            position_embedding_type="none", scatter_embedding_sequence_parallel=False)
    return model.eval()


def _reference_language_model(model, case: Case, cfg) -> dict:
    """HF's text model and tied head on the ids as the class computes them: the embedding table
    looked up unscaled, the logits not soft-capped."""
    text_model = model.model.language_model
    ids = case.data["input_ids"].to(next(model.parameters()).device)
    hidden = text_model(inputs_embeds=F.embedding(ids, text_model.embed_tokens.weight)).last_hidden_state
    logits = model.lm_head(hidden).float()
    return {"logits": logits.reshape(-1, logits.shape[-1]), "loss_mask": case.data["loss_mask"].reshape(-1)}


WHY_NO_WHOLE = ("megatron-core's LLaVAModel has no place for Gemma 4's tower (images of any size, pooled) nor its "
                "images' bidirectional attention on sliding layers, so only the language model has one: stock "
                "GPTModel, which trains it alone")

LANGUAGE_MODEL = dataclasses.replace(
    llava.LANGUAGE_MODEL, build=build_language_model, reference_run=_reference_language_model,
    why_part=WHY_NO_WHOLE, unwritten_extra_state=(),
    # E2B / E4B: the stock class has no per-layer inputs nor layers sharing keys and values.
    refuses=lambda cfg: per_layer.megatron_refusal(cfg.text_config),
    note="the Gemma 4 language model part (language_model.*) on text-only ids, stock GPTModel on Gemma 3's Megatron "
         "layer (TE spec, sandwich norms on linear_proj / linear_fc2, sliding windows) with plain norms, unscaled "
         "attention and the smallest modules megatron-core lacks: a per-layer config and RoPE in the attention "
         "(wider full layers, proportional RoPE), a weightless value norm, the layer scalar; against HF run as the "
         "class computes by design: the embedding unscaled (no sqrt(hidden) in GPTModel) and the logits not "
         f"soft-capped (GPTModel has no cap); {llava.PADDED_LOSS_NOTE}")
MEGATRON = {"GPTModel": LANGUAGE_MODEL}
