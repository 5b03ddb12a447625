"""CPU stand-ins for the Transformer Engine modules Megatron's vision and language classes use.

Megatron-LM specifies its ViT and GPT layers with Transformer Engine (TE) modules
(``get_vit_layer_with_transformer_engine_spec``, ``get_gpt_layer_with_transformer_engine_spec``),
and ``vit_model.py`` builds every extra norm with ``TENorm``. TE needs CUDA, so on a CPU machine
these classes cannot be built as Megatron-LM builds them. The stand-ins here compute the same
functions with plain torch and register exactly the parameters TE registers, under the same names
and, under tensor parallelism, with the same per-rank shapes, so that a state dict written for a
TE-built Megatron model loads into a stand-in-built one strictly and vice versa:

=================================  ================================================================
TE module (Megatron's wrapper)      stand-in and its parameters
=================================  ================================================================
``TENorm``                          :class:`TENorm`: ``torch.nn.LayerNorm`` (``weight``, ``bias``) or
                                    ``torch.nn.RMSNorm`` (``weight``) after ``config.normalization``
``TELayerNormColumnParallelLinear`` :class:`TELayerNormColumnParallelLinear`: ``layer_norm_weight``,
                                    ``layer_norm_bias`` (LayerNorm only), then mcore's
                                    ``ColumnParallelLinear`` (``weight`` rows split over TP ranks,
                                    ``bias`` likewise)
``TEColumnParallelLinear``          :class:`TEColumnParallelLinear`: mcore's ``ColumnParallelLinear``
``TERowParallelLinear``             :class:`TERowParallelLinear`: mcore's ``RowParallelLinear``
                                    (``weight`` columns split, ``bias`` replicated, added once after
                                    the all-reduce)
``TELinear`` (``"duplicated"``)     :class:`TELinear`: ``weight`` (and ``bias``) whole on every TP rank,
                                    no communication (MLA's down projections)
``TEColumnParallelGroupedLinear``   :class:`TEColumnParallelGroupedLinear`: ``weight0`` .. ``weightN-1``
                                    (``TEGroupedMLP``'s fc1 over its N local experts), each
                                    ``[out / expert TP, in]``; one ``_extra_state`` for the module;
                                    sharded as TE's wrapper shards it (global ``weight`` with an
                                    expert axis, an ``_extra_state`` object per expert)
``TERowParallelGroupedLinear``      :class:`TERowParallelGroupedLinear`: likewise, each
                                    ``[out, in / expert TP]`` (fc2); the token dispatcher, not the
                                    linear, reduces over the expert TP ranks, as with TE
``TEDotProductAttention``           :class:`TEDotProductAttention`: softmax attention with
                                    ``torch.nn.functional.scaled_dot_product_attention``; padding-free
                                    packed (THD) input attends within each ``cu_seqlens`` segment
=================================  ================================================================

TE's linears and its attention are ``TransformerEngineBaseModule``\\ s, which put an
``_extra_state`` entry (FP8 metadata) in the state dict; the stand-ins do too (mcore's parallel
linears already have one; :class:`TEDotProductAttention` adds it), so the key sets match. TE's
norms have none.

What the stand-ins assume (each holds for the configurations mmparity builds; anything else is
refused rather than silently computed differently): no FP8/FP4, ``layernorm_zero_centered_gamma``
off, no sequence or context parallelism, no attention bias, dropout 0 (inference), no
``qk_layernorm`` outside what the spec names. Norms compute in the parameter dtype (TE computes
LayerNorm/RMSNorm statistics in fp32 whatever the input; in float32 the two agree).

:func:`vit_layer_spec` and :func:`gpt_layer_spec` return Megatron's own TE specs. When
Transformer Engine is importable they are returned untouched (the real TE modules run); when it is
not, megatron-core still defines the TE wrapper names (as placeholders), and every placeholder in
the spec is replaced by its stand-in, so the spec's structure stays Megatron's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

HAVE_TE: bool = bool(te_ext.HAVE_TE)


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by ``1 + weight`` (TE's ``zero_centered_gamma``, HF's Gemma / Qwen3.5 norms),
    in fp32, cast back to ``x``'s dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class ZeroCentredRMSNorm(torch.nn.Module):
    """TE's ``RMSNorm`` with ``zero_centered_gamma`` (what ``TENorm`` builds under
    ``layernorm_zero_centered_gamma``): key ``weight``, initialised to zeros (a scale of 1)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_rms_norm(x, self.weight, self.eps)


class TENorm:
    """``TENorm(config, hidden_size, eps)``: LayerNorm or RMSNorm after ``config.normalization``.

    Like TE's, a factory: the instance is a plain torch norm whose parameters are ``weight`` (and
    ``bias`` for LayerNorm), the names TE's ``LayerNorm`` / ``RMSNorm`` register.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        if getattr(config, "layernorm_zero_centered_gamma", False):
            if config.normalization != "RMSNorm":
                raise NotImplementedError("TENorm stand-in: zero-centred gamma is modelled for RMSNorm only")
            return ZeroCentredRMSNorm(config, hidden_size, eps)
        if config.normalization == "LayerNorm":
            return torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        if config.normalization == "RMSNorm":
            return torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        raise ValueError(f"TENorm stand-in: unknown normalization {config.normalization!r}")


class TEColumnParallelLinear(ColumnParallelLinear):
    """TE's column-parallel linear: mcore's own ``ColumnParallelLinear`` computes the same thing
    with the same ``weight`` / ``bias`` names and per-rank row split. TE never gathers the output."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method, gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name: Optional[str] = None,
                 tp_group=None, **unused_te_options):
        if gather_output:
            raise ValueError("TE column-parallel linears do not gather their output")
        _refuse_unmodelled(config)
        super().__init__(input_size, output_size, config=config, init_method=init_method,
                         bias=bias, gather_output=False, skip_bias_add=skip_bias_add,
                         is_expert=is_expert,
                         skip_weight_param_allocation=skip_weight_param_allocation,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group)


class TELayerNormColumnParallelLinear(TEColumnParallelLinear):
    """TE's ``LayerNormLinear``: the input norm (``layer_norm_weight`` / ``layer_norm_bias``, over
    the whole unsplit input, replicated on every TP rank) fused in front of a column-parallel
    linear. The norm kind and epsilon come from the config, as TE's wrapper takes them."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm_kind, self.norm_eps = config.normalization, config.layernorm_epsilon
        if self.norm_kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"stand-in: unknown normalization {self.norm_kind!r}")
        # TE's zero_centered_gamma: the norm scales by 1 + layer_norm_weight (RMSNorm is modelled).
        self.zero_centred = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        if self.zero_centred and self.norm_kind != "RMSNorm":
            raise NotImplementedError("stand-in: zero-centred gamma is modelled for RMSNorm only")
        init = torch.zeros if self.zero_centred else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype))
        if self.norm_kind == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, dtype=config.params_dtype))
        else:
            self.register_parameter("layer_norm_bias", None)

    def forward(self, input_, *args, **kwargs):
        if self.norm_kind == "LayerNorm":
            normed = F.layer_norm(input_, (input_.shape[-1],), self.layer_norm_weight,
                                  self.layer_norm_bias, self.norm_eps)
        elif self.zero_centred:
            normed = zero_centred_rms_norm(input_, self.layer_norm_weight, self.norm_eps)
        else:
            normed = F.rms_norm(input_, (input_.shape[-1],), self.layer_norm_weight, self.norm_eps)
        return super().forward(normed, *args, **kwargs)


class TERowParallelLinear(RowParallelLinear):
    """TE's row-parallel linear: mcore's own ``RowParallelLinear`` (``weight`` split along its
    input dimension, ``bias`` replicated and added after the all-reduce)."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method, bias: bool, input_is_parallel: bool, skip_bias_add: bool,
                 is_expert: bool, tp_comm_buffer_name: Optional[str] = None, tp_group=None,
                 **unused_te_options):
        if not input_is_parallel:
            raise ValueError("TE row-parallel linears take parallel input")
        _refuse_unmodelled(config)
        super().__init__(input_size, output_size, config=config, init_method=init_method,
                         bias=bias, input_is_parallel=True, skip_bias_add=skip_bias_add,
                         is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
                         tp_group=tp_group)


class TELinear(MegatronModule):
    """TE's plain ``Linear`` as Megatron wraps it, in its ``"duplicated"`` mode, the one Megatron's
    specs use it in (MLA's ``linear_q_down_proj`` / ``linear_kv_down_proj``): the whole ``weight``
    ``[out, in]`` (and ``bias``) on every TP rank, no communication. Returns ``(output, bias)``
    like every Megatron linear (the bias is added unless ``skip_bias_add``)."""

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: Optional[str],
                 config: TransformerConfig, init_method, bias: bool, skip_bias_add: bool,
                 skip_weight_param_allocation: bool, tp_comm_buffer_name: Optional[str] = None,
                 is_expert: bool = False, symmetric_ar_type: Optional[str] = None, tp_group=None,
                 name: Optional[str] = None):  # name: megatron-core 0.19 labels modules, unused here
        super().__init__(config=config)
        if parallel_mode != "duplicated":
            raise NotImplementedError(f"TELinear stand-in: parallel_mode {parallel_mode!r} is not modelled "
                                      "(Megatron's specs use TEColumn/RowParallelLinear for split ones)")
        if skip_weight_param_allocation:
            raise ValueError("Transformer Engine linear layers do not support skip_weight_param_allocation")
        _refuse_unmodelled(config)
        self.parallel_mode = None  # TE's wrapper records "duplicated" as no parallel mode
        self.skip_bias_add = skip_bias_add
        # A duplicated weight is built without a TP group, but TE's wrapper still keeps the default
        # one: each TP rank's copy is then a replica of its own (replica id (0, tp rank, dp rank)),
        # which a sharded save or load needs to find exactly one main copy.
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        self._tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        return None

    def forward(self, x):
        if self.bias is None:
            return F.linear(x, self.weight), None
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Replicated over TP and DP, as TE's wrapper gives it: one replica per TP and DP rank."""
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, None,
                                                   sharded_offsets, tp_group=self._tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


class _GroupedLinear(MegatronModule):
    """TE's ``GroupedLinear`` as Megatron wraps it (``TEGroupedLinear``): ``num_gemms`` linears, one
    per local expert, registered ``weight0`` .. ``weight{N-1}`` (and ``bias{i}``), each split over
    the expert TP ranks along ``parallel_mode``'s axis. Like TE under expert parallelism or
    expert TP > 1, it does no communication itself (the token dispatcher does), and at expert TP 1
    there is nothing to communicate. ``forward(x, m_splits)``: rows of ``x`` in expert order,
    ``m_splits`` rows per expert."""

    parallel_mode: str = ""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method, bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: Optional[str] = None, pg_collection=None, name: Optional[str] = None):
        super().__init__(config=config)
        if not is_expert:
            raise ValueError("TEGroupedLinear only supports expert parallelism")
        if bias:
            raise NotImplementedError("grouped-linear stand-in: expert biases are not modelled")
        _refuse_unmodelled(config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import get_pg_size
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        self.use_bias = False
        tp = get_pg_size(pg_collection.expt_tp)
        if self.parallel_mode == "column":
            output_size //= tp
        else:
            input_size //= tp
        self.num_gemms = num_gemms
        self._register_load_state_dict_pre_hook(_merge_expert_extra_states, with_module=True)
        # As TE's wrapper marks them: expert weights under expert parallelism (or an expert TP
        # other than TP) belong to the expert groups (``allreduce=False``: DDP reduces and
        # gathers them over expert data parallelism, not over the data-parallel ranks that hold
        # other experts), and each is split over expert TP along this linear's axis.
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        expert_tp = getattr(config, "expert_tensor_parallel_size", None) or config.tensor_model_parallel_size
        use_expert_groups = config.expert_model_parallel_size > 1 or expert_tp != config.tensor_model_parallel_size
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            if config.perform_initialization:
                init_method(weight)
            weight.allreduce = not use_expert_groups
            set_tensor_model_parallel_attributes(weight, True, 0 if self.parallel_mode == "column" else 1, 1)
            self.register_parameter(f"weight{i}", weight)

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        return None

    # Which axis of each expert's weight the expert TP ranks split (TE's wrappers: fc1's rows,
    # fc2's columns).
    _tp_axis: int = 0

    def _split_extra_state(self, state) -> list:
        """One extra state per expert out of the module's one, as ``TEGroupedLinear`` splits it;
        without FP8 (all the stand-ins model) every expert gets the module's state as it is."""
        return [state] * self.num_gemms

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The layout of ``TEGroupedLinear._sharded_state_dict_grouped``: each local expert ``i``
        (global ``g = EP rank · N + i`` of ``EP · N``) becomes one shard of global tensors keyed
        as the sequential experts' are, ``<prefix>weight`` with an expert axis prepended after
        ``sharded_offsets`` (offset ``g``) and this module's split over the expert TP ranks on
        ``_tp_axis``, and ``<prefix>_extra_state`` on the same expert axis. The entries are named
        ``<prefix>weight<i>`` and ``<prefix>_extra_state`` (expert 0) / ``_extra_state<i>``, the
        names ``TEGroupedMLP`` looks for, and every replica id's data-parallel part is the rank in
        the expert data-parallel group (experts are replicated over DP modulo EP).
        ``singleton_local_shards`` metadata keeps one tensor per expert instead
        (``<g>.<prefix>weight``, no expert axis)."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint)
        from megatron.core.utils import get_pg_rank, get_pg_size
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = (metadata or {}).get("singleton_local_shards", False)
        ep_size, ep_rank = get_pg_size(self._pg_collection.ep), get_pg_rank(self._pg_collection.ep)
        total = ep_size * self.num_gemms
        edp_rank = get_pg_rank(self._pg_collection.expt_dp)
        own = self.state_dict(prefix="", keep_vars=True)
        extra_states = self._split_extra_state(own["_extra_state"])
        out = {}
        for i in range(self.num_gemms):
            expert = ep_rank * self.num_gemms + i
            local = {f"{i}.weight": own[f"weight{i}"], f"{i}._extra_state": extra_states[i]}
            if singleton:
                sharded_prefix, offsets = f"{expert}.{prefix}", tuple(sharded_offsets)
            else:
                sharded_prefix = prefix
                offsets = (*sharded_offsets, (len(sharded_offsets), expert, total))
            shards = make_sharded_tensors_for_checkpoint(
                local, "", {f"{i}.weight": self._tp_axis}, offsets, tp_group=self._tp_group,
                dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(shards, f"{i}.", sharded_prefix)
            out[f"{prefix}weight{i}"] = shards[f"{i}.weight"]
            out[f"{prefix}_extra_state{i or ''}"] = shards[f"{i}._extra_state"]
        for shard in out.values():
            if len(shard.replica_id) != 3:
                raise ValueError(f"{shard.key}: replica id {shard.replica_id} is not (PP, TP, DP)")
            fully_sharded = getattr(shard, "is_data_parallel_fully_shard", False)  # Megatron-FSDP's
            shard.replica_id = (*shard.replica_id[:2], 0 if fully_sharded else edp_rank)
        return out

    def forward(self, x, m_splits):
        chunks = torch.split(x, list(m_splits))
        out = torch.cat([F.linear(chunk, getattr(self, f"weight{i}")) for i, chunk in enumerate(chunks)])
        return out, None


def _merge_expert_extra_states(module: _GroupedLinear, state_dict, prefix, *unused) -> None:
    """The load pre-hook ``TEGroupedLinear`` registers (``merge_extra_states``): a dist-checkpoint
    load hands the module one extra state per expert (``_extra_state``, ``_extra_state1`` ..
    ``_extra_state{N-1}``, as :meth:`_GroupedLinear.sharded_state_dict` names them); it takes
    ``_extra_state1`` onwards out, stopping at the first absent one (a plain state dict has only
    ``_extra_state``), and keeps ``_extra_state`` for the module. TE then merges the experts' FP8
    scales into it when they hold any; the stand-ins model no FP8, so there is nothing to merge."""
    if not any("_extra_state" in str(key) for key in state_dict):
        return
    for i in range(1, module.num_gemms):
        if f"{prefix}_extra_state{i}" not in state_dict:
            return
        state_dict.pop(f"{prefix}_extra_state{i}")


class TEColumnParallelGroupedLinear(_GroupedLinear):
    """``TEGroupedMLP``'s fc1: each expert's weight split by rows over the expert TP ranks."""

    parallel_mode = "column"


class TERowParallelGroupedLinear(_GroupedLinear):
    """``TEGroupedMLP``'s fc2: each expert's weight split by columns over the expert TP ranks."""

    parallel_mode = "row"
    _tp_axis = 1


class TEDotProductAttention(MegatronModule):
    """Softmax attention over this rank's heads, in the layouts mcore hands TE's attention.

    ``(s, b, heads, d)`` query / key / value (key and value may hold fewer query groups, GQA), or,
    with THD ``packed_seq_params``, ``(t, heads, d)`` where ``cu_seqlens_q`` / ``cu_seqlens_kv``
    delimit independent sequences. ``attn_mask_type`` ``no_mask`` attends everywhere, ``causal``
    below the diagonal; an explicit boolean ``attention_mask`` (True = masked, mcore's convention)
    is honoured for ``padding``-style masks. Returns ``(s, b, heads·d)`` or ``(t, heads·d)``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, **unused_te_options):
        super().__init__(config=config)
        _refuse_unmodelled(config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise NotImplementedError("TEDotProductAttention stand-in: dropout is not modelled")
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        # Sliding-window attention where megatron-core's TE wrapper hands TE a window: (left,
        # right), a query at i sees the keys i - left .. i + right (and the mask's).
        from megatron.core.transformer.utils import is_layer_window_attention
        self.window = (tuple(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)

    def get_extra_state(self):
        """TE's attention carries FP8 metadata here; the key must exist for layouts to match."""
        return None

    def set_extra_state(self, state) -> None:
        return None

    def _attend(self, q, k, v, mask_type: AttnMaskType, mask: Optional[torch.Tensor]):
        """(b, heads, s, d) each -> (b, heads, s, d)."""
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if self.window is not None:
            q_at = torch.arange(q.shape[2], device=q.device)[:, None] + (k.shape[2] - q.shape[2])
            k_at = torch.arange(k.shape[2], device=q.device)[None, :]
            outside = (k_at < q_at - self.window[0]) | (k_at > q_at + self.window[1])
            mask = outside if mask is None else mask.bool() | outside
        if mask is not None:
            allowed = ~mask
            if causal:
                allowed = allowed & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool,
                                               device=q.device).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1,
                                              scale=self.softmax_scale)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if attention_bias is not None:
            raise NotImplementedError("TEDotProductAttention stand-in: attention_bias is not modelled")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type == AttnMaskType.no_mask:
            attention_mask = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_q = packed_seq_params.cu_seqlens_q.tolist()
            cu_kv = packed_seq_params.cu_seqlens_kv.tolist()
            outs = []
            for (q0, q1), (k0, k1) in zip(zip(cu_q, cu_q[1:]), zip(cu_kv, cu_kv[1:])):
                q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in
                           (query[q0:q1], key[k0:k1], value[k0:k1]))
                outs.append(self._attend(q, k, v, mask_type, None)[0].transpose(0, 1))
            out = torch.cat(outs, dim=0)
            return out.reshape(out.shape[0], -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend(q, k, v, mask_type, attention_mask)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _refuse_unmodelled(config: TransformerConfig) -> None:
    problems = [name for name in ("fp8", "fp4") if getattr(config, name, None)]
    if getattr(config, "sequence_parallel", False):
        problems.append("sequence_parallel")
    if getattr(config, "context_parallel_size", 1) > 1:
        problems.append("context_parallel_size > 1")
    if problems:
        raise NotImplementedError(f"TE stand-ins do not model {', '.join(problems)}")


# Megatron's TE wrapper names and the stand-in for each; the wrappers exist in megatron-core with
# or without TE (without it they are placeholders that cannot be built).
_STAND_INS = {
    "TENorm": TENorm,
    "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinear,
    "TEColumnParallelLinear": TEColumnParallelLinear,
    "TERowParallelLinear": TERowParallelLinear,
    "TEDotProductAttention": TEDotProductAttention,
    "TELinear": TELinear,
    "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinear,
    "TERowParallelGroupedLinear": TERowParallelGroupedLinear,
}


def te_class(name: str):
    """The class Megatron's spec means by ``name``: TE's own wrapper when TE is importable, else
    the stand-in."""
    if name not in _STAND_INS:
        raise KeyError(f"no stand-in for {name!r}; known: {', '.join(_STAND_INS)}")
    return getattr(te_ext, name) if HAVE_TE else _STAND_INS[name]


class TENormWithResidual:
    """megatron-core 0.19's spec adapter ``TENorm(..., has_residual=True)``: a residual-fused norm
    only under ``config.fused_residual_rmsnorm``, which is not modelled; otherwise TENorm itself."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        if getattr(config, "fused_residual_rmsnorm", False):
            raise NotImplementedError("TENorm stand-in: fused_residual_rmsnorm is not modelled")
        return TENorm(config, hidden_size, eps)


def _placeholder_map() -> dict:
    """id of each TE wrapper megatron-core defines -> the class to build instead."""
    mapping = {id(getattr(te_ext, name)): te_class(name) for name in _STAND_INS
               if getattr(te_ext, name, None) is not None}
    try:  # 0.19's specs name an adapter of TENorm rather than TENorm itself
        from megatron.core.extensions.transformer_engine_spec_provider import _TENormWithResidual
    except ImportError:
        return mapping
    mapping[id(_TENormWithResidual)] = TENormWithResidual
    return mapping


def substitute_te(spec, mapping: Optional[dict] = None):
    """A copy of a Megatron spec (``ModuleSpec``, submodule dataclasses, ``functools.partial``,
    nested in any way) with every TE wrapper replaced by the class :func:`te_class` names."""
    mapping = _placeholder_map() if mapping is None else mapping
    if id(spec) in mapping:
        return mapping[id(spec)]
    if isinstance(spec, functools.partial):
        return functools.partial(substitute_te(spec.func, mapping),
                                 *(substitute_te(a, mapping) for a in spec.args),
                                 **{k: substitute_te(v, mapping) for k, v in spec.keywords.items()})
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: substitute_te(getattr(spec, f.name), mapping)
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    if isinstance(spec, dict):
        return {k: substitute_te(v, mapping) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(substitute_te(v, mapping) for v in spec)
    return spec


def unresolved_te(spec) -> list[str]:
    """Names of TE wrappers still in ``spec`` that cannot be built here (empty once substituted)."""
    if HAVE_TE:
        return []
    # Without TE, megatron-core's TE wrappers are mock objects (or None for optional ones).
    placeholders = {id(obj): n for n, obj in vars(te_ext).items()
                    if n.startswith("TE") and type(obj).__module__ == "unittest.mock"}
    found: list[str] = []

    def walk(obj):
        if id(obj) in placeholders:
            found.append(placeholders[id(obj)])
        elif isinstance(obj, functools.partial):
            walk(obj.func)
            for a in (*obj.args, *obj.keywords.values()):
                walk(a)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(spec)
    return found


def vit_layer_spec() -> ModuleSpec:
    """Megatron-LM's ViT layer spec with TE (bidirectional, ``no_mask``), TE swapped for the
    stand-ins when TE is not importable."""
    return _checked(substitute_te(get_vit_layer_with_transformer_engine_spec()))


def gpt_layer_spec() -> ModuleSpec:
    """Megatron-LM's dense GPT layer spec with TE (causal, norms fused into ``linear_qkv`` and
    ``linear_fc1``).

    With TE importable this is ``get_gpt_layer_with_transformer_engine_spec()`` itself. Without
    it megatron-core cannot even assemble that spec (its TE backend provider is not defined), so
    the equivalent is derived from the ViT TE spec, which for a dense layer without
    ``qk_layernorm`` has the same modules and differs only in the causal mask."""
    if HAVE_TE:
        return get_gpt_layer_with_transformer_engine_spec()
    spec = vit_layer_spec()
    attention = spec.submodules.self_attention
    causal = dataclasses.replace(attention, params={**attention.params,
                                                    "attn_mask_type": AttnMaskType.causal})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                   self_attention=causal))


@contextlib.contextmanager
def qk_norm_without_te():
    """megatron-core's TE spec provider picks the q/k norm by TE's version, which it cannot read
    without TE; TE >= 1.9 gives ``TENorm`` (the stand-in here), which is what it is told. Its block
    specs ask for it whether or not the config has q/k norms."""
    if HAVE_TE:
        yield
        return
    from megatron.core.extensions import transformer_engine_spec_provider as provider

    saved = provider.is_te_min_version
    provider.is_te_min_version = lambda *unused, **unused_kw: True
    try:
        yield
    finally:
        provider.is_te_min_version = saved


def gpt_decoder_block_spec(config: TransformerConfig):
    """Megatron-LM's GPT decoder block spec with TE for ``config``, this pipeline stage's layers:
    ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``, which for a MoE / MLA
    config (DeepSeek-V3, Kimi-K2) gives dense layers up to ``moe_layer_freq``'s first MoE layer and
    ``get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm,
    qk_layernorm, multi_latent_attention)`` layers after (MLA with TE's "duplicated" ``TELinear``
    down projections and norm-fused up projections, ``MoELayer`` with ``TEGroupedMLP`` experts and a
    ``SharedExpertMLP``), ``TENorm`` as the final norm (see :func:`megatron_te_spec`)."""
    from megatron.core.models.gpt import gpt_layer_specs
    return megatron_te_spec(gpt_layer_specs.get_gpt_decoder_block_spec, config, use_transformer_engine=True)


def megatron_te_spec(spec_function, *args, **kwargs):
    """``spec_function(*args, **kwargs)``, one of megatron-core's GPT spec functions asked for TE
    (``get_gpt_decoder_block_spec(..., use_transformer_engine=True)``,
    ``get_gpt_layer_with_transformer_engine_spec``), with the stand-ins where TE is absent.

    With TE importable that is the spec itself. Without it megatron-core's spec module never
    defines ``TESpecProvider`` / ``TENorm`` and the provider falls back to the legacy
    ``GroupedMLP`` (TE's grouped linears are ``None``): for the call, those names point at the
    provider, the placeholder and the grouped-linear stand-ins, so Megatron's own functions choose
    every module; then each placeholder is replaced by its stand-in."""
    from megatron.core.models.gpt import gpt_layer_specs
    if HAVE_TE:
        return spec_function(*args, **kwargs)
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    missing = object()
    saved = []

    def swap(module, name, value):
        saved.append((module, name, getattr(module, name, missing)))
        setattr(module, name, value)

    try:
        swap(gpt_layer_specs, "TENorm", te_ext.TENorm)
        swap(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider)
        swap(provider, "TEColumnParallelGroupedLinear", TEColumnParallelGroupedLinear)
        swap(provider, "TERowParallelGroupedLinear", TERowParallelGroupedLinear)
        spec = spec_function(*args, **kwargs)
    finally:
        for module, name, value in reversed(saved):
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)
    return _checked(substitute_te(spec))


def projector_spec(normed: bool = False):
    """The MLP submodules Megatron-LM gives ``MultimodalProjector`` with TE (column-parallel fc1,
    row-parallel fc2; the norm fused into fc1 where the projector has one, as its NVLM-style
    projector's), stand-ins when needed."""
    return MLPSubmodules(linear_fc1=te_class("TELayerNormColumnParallelLinear" if normed else "TEColumnParallelLinear"),
                         linear_fc2=te_class("TERowParallelLinear"))


def _checked(spec):
    left = unresolved_te(spec)
    if left:
        raise RuntimeError(f"Megatron's spec uses TE modules with no stand-in: {sorted(set(left))}")
    return spec


@contextlib.contextmanager
def buildable_without_te(*modules):
    """While building Megatron's classes on a machine without TE, make the module-level choices
    they make at import time point at the stand-ins.

    * ``vit_model.py`` binds ``_NORM_IMPL = TENorm`` and asserts ``HAVE_TE`` in every constructor;
      megatron-core's TE placeholder lets that import succeed, but building it fails.
    * ``multi_latent_attention`` builds its down projections in TE's "duplicated" mode only when
      the spec's class is the ``TELinear`` it imported (the placeholder); it is the stand-in here.
    * ``transformer_block`` gives a block built from one layer's spec ``LayerNormImpl`` as its final
      norm: ``TENorm`` with TE, a torch norm without;
    * stock ``clip_vit_model.CLIPViTModel`` defaults ``ln_pre_impl`` / ``ln_post_impl`` to
      ``torch.nn.LayerNorm`` without TE, which cannot be built with TENorm's arguments; with TE the
      default is ``TENorm``. It also moves its position ids with ``.cuda()`` at construction.

    With TE installed this changes nothing. The changes are undone on exit; modules already built
    keep their stand-in norms.
    """
    if HAVE_TE:
        yield
        return
    saved: list = []

    def swap(obj, attr, value):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    try:
        for module in modules:
            # MLA picks the down projections' mode by identity with the TELinear it imported
            # (megatron-core 0.16: the mock-derived class; 0.19 imports None without TE).
            if hasattr(module, "TELinear") and (module.TELinear is None or
                                                module.TELinear is getattr(te_ext, "TELinear", None)):
                swap(module, "TELinear", TELinear)
            # megatron-core 0.19's MLA asks its backend (TESpecProvider) which class is the fused
            # norm + linear and accepts the spec's only if it is that class.
            for name in ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear"):
                if module.__name__.endswith("transformer_engine_spec_provider") and hasattr(module, name):
                    swap(module, name, te_class(name))
            # transformer_block's final norm for a block built from one layer spec: TENorm where
            # TE is importable, a torch norm (which refuses zero-centred gamma) otherwise.
            if hasattr(module, "LayerNormImpl"):
                swap(module, "LayerNormImpl", TENorm)
            if hasattr(module, "_NORM_IMPL"):
                swap(module, "_NORM_IMPL", TENorm)
                swap(module, "HAVE_TE", True)
            clip_cls = getattr(module, "CLIPViTModel", None)
            if clip_cls is not None and clip_cls.__module__ == module.__name__:
                defaults = tuple(TENorm if d is torch.nn.LayerNorm else d
                                 for d in clip_cls.__init__.__defaults__)
                swap(clip_cls.__init__, "__defaults__", defaults)
        with cuda_calls_on_host():
            yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


@contextlib.contextmanager
def cuda_calls_on_host():
    """On a machine without CUDA, let Megatron's hard-wired CUDA placements stay on the host.

    ``CLIPViTModel`` calls ``.cuda()`` on its position ids when built, and ``GPTModel``'s
    ``RotaryEmbedding`` moves its frequencies to ``torch.cuda.current_device()`` on its first
    forward. Inside this context ``Tensor.cuda`` returns the tensor itself and
    ``torch.cuda.current_device()`` names the CPU. With CUDA present it changes nothing.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = (torch.Tensor.cuda, torch.cuda.current_device)
    torch.Tensor.cuda = _stay_on_host
    torch.cuda.current_device = _host_device
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.cuda.current_device = saved


def _stay_on_host(tensor: torch.Tensor, *unused, **unused_kw) -> torch.Tensor:
    return tensor


def _host_device() -> str:
    return "cpu"
