"""mcore layer specs for bidirectional vision transformers, with or without Transformer Engine.

Without TE we still want the parameter names Megatron-LM training produces with TE
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``), so that a
checkpoint written by the converter loads into the native model as is. :class:`NormedColumnParallelLinear`
is the local-spec equivalent of ``TELayerNormColumnParallelLinear``: the pre-attention / pre-MLP
norm lives inside the following column-parallel linear.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

try:  # mcore moved this helper between releases; both spellings behave the same.
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
except ImportError:  # pragma: no cover
    from megatron.core.transformer.fused_bias_dropout import get_bias_dropout_add

from mmparity.models.core.attention import BidirectionalCoreAttention
from mmparity.parallel import runtime


_SKIP_INITIALIZATION = contextvars.ContextVar("skip_initialization", default=False)


@contextlib.contextmanager
def without_initialization():
    """Build without running mcore's init kernels: the weights are loaded over them anyway, and on
    a model of hundreds of GB (``check --low-memory``) initialising it on the host would take
    longer than the check, and need the memory the check avoids."""
    token = _SKIP_INITIALIZATION.set(True)
    try:
        yield
    finally:
        _SKIP_INITIALIZATION.reset(token)


def performs_initialization() -> bool:
    """``TransformerConfig.perform_initialization`` for a model built here and now."""
    return torch.get_default_device().type != "meta" and not _SKIP_INITIALIZATION.get()


def get_pg_size(group) -> int:
    return group.size() if group is not None else 1


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               kind: str) -> torch.Tensor:
    if kind == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class NormedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel linear with its input norm fused in, TE-compatible parameter names."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm_kind = config.normalization
        self.norm_eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=config.params_dtype))
        if self.norm_kind == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, dtype=config.params_dtype))
        else:
            self.register_parameter("layer_norm_bias", None)
        # The fused norm's output, as a module of its own (no parameters: the state dict is
        # unchanged) so that parity can hook it and pair it with HF's separate norm.
        self.normed = torch.nn.Identity()

    def norm(self, input_: torch.Tensor) -> torch.Tensor:
        return layer_norm(input_, self.layer_norm_weight, self.layer_norm_bias, self.norm_eps,
                          self.norm_kind)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        normed = self.normed(self.norm(input_))
        if weight is not None or runtime_gather_output or self.gather_output or self.sequence_parallel:
            return super().forward(normed, weight, runtime_gather_output)
        # mcore adds the bias as a separate broadcast add (or hands it back with skip_bias_add),
        # which on H200 ran as a slow non-vectorised kernel: 13-34 ms per forward of the 27-layer
        # towers. F.linear puts the bias in the GEMM epilogue. Every caller of a column-parallel
        # linear here treats a returned bias of None as "already added".
        if get_pg_size(self.tp_group) > 1:
            normed = copy_to_tensor_model_parallel_region(normed, group=self.tp_group)
        return F.linear(normed, self.weight, self.bias), None


class BiasInGemmRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose bias rides in the GEMM epilogue at TP=1 (see above).

    With TP > 1 the bias must be added once after the all-reduce, so mcore's own path runs.
    """

    def forward(self, input_):
        if get_pg_size(self.tp_group) > 1 or self.sequence_parallel or self.bias is None:
            return super().forward(input_)
        return F.linear(input_, self.weight, self.bias), None


def vision_layer_spec(core_attention: type | None = None) -> ModuleSpec:
    """A bidirectional (``no_mask``) transformer layer in the TE key spelling."""
    return layer_spec(core_attention or BidirectionalCoreAttention, AttnMaskType.no_mask)


def layer_spec(core_attention: type, attn_mask_type: AttnMaskType) -> ModuleSpec:
    """A pre-norm transformer layer whose norms live in the following linears (TE key spelling)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": attn_mask_type},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=NormedColumnParallelLinear,
                    core_attention=core_attention,
                    linear_proj=BiasInGemmRowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=NormedColumnParallelLinear,
                                         linear_fc2=BiasInGemmRowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def run_fields(params_dtype: torch.dtype) -> dict:
    """The ``TransformerConfig`` fields every config here sets alike: no fused kernels and no
    dropout (the runs are compared against transformers on any device), weights made on the host
    as Megatron-LM's CPU initialisation makes them, and the dtype."""
    return dict(
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        # A model built on the meta device only describes shapes and sharding (the converter's
        # torch_dist planning); running the init kernels on it was most of the build (Qwen3.5's
        # tower: 0.05 s with them, 0.014 s without).
        perform_initialization=performs_initialization(),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )


def moe_fields(**fields) -> dict:
    """A MoE language model's own ``fields`` (experts, widths, router) with what every MoE here
    runs with: routing in fp32, no load-balancing loss (forward only), the all-gather dispatcher,
    the experts one after another (grouped GEMM needs Transformer Engine), spread over the
    current layout's EP ranks."""
    fields.update(moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
    layout = runtime.current_layout()
    if layout is not None:
        fields["expert_model_parallel_size"] = getattr(layout, "ep", 1)
    return fields


def add_stage_fields(fields: dict, *, pipelined_stack: bool = True) -> dict:
    """``fields`` with the current layout's TP and PP sizes where they name none, and, for a layer
    stack split over the pipeline stages (``pipelined_stack``), the fields under which mcore builds
    the parallel state's ``layer_counts`` (mcore's even split when it has none)."""
    layout = runtime.current_layout()
    if layout is not None:
        fields.setdefault("tensor_model_parallel_size", layout.tp)
        fields.setdefault("pipeline_model_parallel_size", runtime.pipeline_size())
    counts = runtime.stage_layer_counts()
    if pipelined_stack and counts is not None and fields["pipeline_model_parallel_size"] > 1:
        if sum(counts) != fields["num_layers"]:
            raise ValueError(f"the pipeline split {list(counts)} covers {sum(counts)} layers; this "
                             f"stack has {fields['num_layers']}")
        for key, value in runtime.uneven_stage_fields(counts).items():
            fields.setdefault(key, value)
    return fields


def vision_transformer_config(*, num_layers: int, hidden_size: int, num_attention_heads: int,
                              ffn_hidden_size: int, normalization: str, norm_eps: float,
                              activation: Callable, gated: bool, bias: bool,
                              num_query_groups: int | None = None, kv_channels: int | None = None,
                              rotary_interleaved: bool = False,
                              params_dtype: torch.dtype = torch.float32,
                              pipelined_stack: bool = True,
                              **overrides) -> TransformerConfig:
    """The TransformerConfig every native vision tower derives from its HF config.

    Under pipeline parallelism a config with ``pipelined_stack`` describes the layer stack that is
    split over the stages, as the parallel state's ``layer_counts`` say (mcore's even split when it
    has none). Projector and head configs, whose ``num_layers`` builds nothing, pass False.
    """
    fields = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups or num_attention_heads,
        kv_channels=kv_channels,
        ffn_hidden_size=ffn_hidden_size,
        normalization=normalization,
        layernorm_epsilon=norm_eps,
        activation_func=activation,
        gated_linear_unit=gated,
        add_bias_linear=bias,
        add_qkv_bias=bias,
        rotary_interleaved=rotary_interleaved,
        **run_fields(params_dtype),
    )
    fields.update(overrides)
    return TransformerConfig(**add_stage_fields(fields, pipelined_stack=pipelined_stack))


def numbered_layers(block) -> list:
    """``(global index, layer)`` of an mcore block's layers: a pipeline stage holds a slice of the
    stack, and divergences are named by the layer's place in the whole model."""
    return [(layer.layer_number - 1, layer) for layer in block.layers]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_HF_ACTIVATIONS: dict[str, Callable] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "quick_gelu": quick_gelu,
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
}


def activation_from_hf(name: str) -> Callable:
    """The exact function behind an HF ``hidden_act`` string (erf GELU and tanh GELU differ)."""
    try:
        return _HF_ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; known: {', '.join(sorted(_HF_ACTIVATIONS))}") from None


def tolerate_missing_extra_state(model: torch.nn.Module) -> None:
    """Let ``load_state_dict(strict=True)`` accept state dicts without mcore's ``_extra_state`` keys.

    Local-spec mcore linears report an ``_extra_state`` of ``None``; converted checkpoints carry
    tensors only. Every other key stays strict.
    """
    holders = [name for name, module in model.named_modules()
               if type(module).get_extra_state is not torch.nn.Module.get_extra_state]

    def fill(state_dict, prefix, *unused):
        for name in holders:
            key = f"{prefix}{name}._extra_state" if name else f"{prefix}_extra_state"
            state_dict.setdefault(key, None)

    model._register_load_state_dict_pre_hook(fill)
