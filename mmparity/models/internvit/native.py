"""Native InternViT: ``ViTModel`` in Megatron-LM's ``CLIPViTModel`` InternViT layout, on layers
built as Megatron-LM's InternViT layer specs build theirs.

The tower (``mmparity.models.core.vit.ViTModel``): patch conv with a bias under ``conv1``, one
class token, a learned absolute position table (resampled bicubically for other grids, as
transformers does), no ``ln_pre``; the final LayerNorm (``ln_post``, on every token) only where
transformers has one (``use_mean_pooling`` off), which Megatron's class has no place for.

Each layer is what Megatron-LM's ``get_internvit_layer_spec`` / ``get_internvit300M_layer_spec``
describe, with their key names: separate ``input_layernorm`` / ``pre_mlp_layernorm`` (not fused
into the next linear), ``self_attention.linear_qkv`` with a bias only where transformers has q/k/v
biases (``attention_bias``), ``q_layernorm`` / ``k_layernorm`` over every head of the rank (the
statistic summed over the TP ranks, so it spans the whole width as transformers' does), and the
layer scales ``ls1`` / ``ls2`` applied to the attention and MLP outputs before the residual add.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmparity.config import first_int, image_hw, vision_of
from mmparity.models.core.attention import BidirectionalCoreAttention
from mmparity.models.core.layers import (
    BiasInGemmRowParallelLinear, activation_from_hf, get_pg_size, vision_transformer_config)
from mmparity.models.core.vit import ViTModel
from mmparity.models.internvit.config import QK_NORM_EPS, transformer_fields

MODEL_TYPES = ("internvl_vision",)
CLASS_TOKEN_LEN = 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, width: int | None = None,
             group=None) -> torch.Tensor:
    """RMSNorm as transformers and Megatron-LM's InternViT compute it: the statistic and the
    scaling in float32, cast back, then the weight. With ``group`` the mean of squares is summed
    over its ranks (each holds a slice of the ``width`` features)."""
    x32 = x.float()
    squares = x32.pow(2).sum(-1, keepdim=True)
    if group is not None and get_pg_size(group) > 1:
        squares = reduce_from_tensor_model_parallel_region(squares, group=group)
    variance = squares / (width or x.shape[-1])
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


class InternViTNorm(MegatronModule):
    """A layer's norm, built as mcore builds ``input_layernorm`` (``config``, ``hidden_size``,
    ``eps``): LayerNorm with a bias, or RMSNorm (weight only), as ``config.normalization``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__(config=config)
        self.kind, self.eps = config.normalization, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if self.kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "RMSNorm":
            return rms_norm(x, self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class WholeWidthQKNorm(MegatronModule):
    """transformers' q/k RMSNorm spans all heads (the whole hidden width), not one head as mcore's
    ``q_layernorm`` does: this rank's weight covers its heads, and the mean of squares is summed
    over the TP ranks (Megatron-LM's ``InternViTRMSNorm(compute_var=True)`` does the same, for its
    padded 25-head release). ``hidden_size`` (mcore passes one head's width) is not read: the
    width is the rank's heads. Its epsilon is transformers' fixed one, not the config's."""

    def __init__(self, config: TransformerConfig, hidden_size: int = 0, eps: float = QK_NORM_EPS):
        super().__init__(config=config)
        self.width = config.kv_channels * config.num_attention_heads
        local = self.width // config.tensor_model_parallel_size
        self.weight = torch.nn.Parameter(torch.ones(local, dtype=config.params_dtype))
        self.eps = QK_NORM_EPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., heads, head_dim] -> one vector of every head of the rank, and back.
        from megatron.core import parallel_state

        flat = x.reshape(*x.shape[:-2], -1)
        group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        return rms_norm(flat, self.weight, self.eps, self.width, group).view_as(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The weight split over TP along its one axis, as the heads it scales are: a distributed
        checkpoint holds the whole width once (MegatronModule's default would call it replicated,
        and a TP 2 load would read the whole width into each rank's half)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint)

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(check_initialized=False),
            dp_cp_group=metadata["dp_cp_group"])


def qkv_linear(base: type) -> type:
    """``base`` as ``linear_qkv``, with a bias only where transformers has q/k/v biases: mcore
    biases it whenever the other linears are (``add_bias_linear``), transformers'
    ``attention_bias`` is separate (Megatron-LM's InternViT attention overrides it the same way)."""

    class QKVLinear(base):
        def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, bias: bool = True,
                     **kwargs):
            super().__init__(input_size, output_size, config=config, bias=config.add_qkv_bias, **kwargs)

    QKVLinear.__name__ = QKVLinear.__qualname__ = f"QKV{base.__name__}"
    return QKVLinear


QKVLinear = qkv_linear(ColumnParallelLinear)


def _scaled_residual_add(scale: torch.Tensor, training: bool, fused: bool):
    """mcore's bias-dropout-add with the branch scaled by ``scale`` before the residual add:
    ``residual + dropout(x + bias) * scale`` (transformers' ``lambda_1`` / ``lambda_2``)."""

    def add(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        x = F.dropout(x, p=prob, training=training)
        return residual.to(x.dtype) + x * scale.to(x.dtype)

    return add


def _unused_bda(training: bool, fused: bool):
    raise AssertionError("replaced by the layer's scaled residual add")


class LayerScaledTransformerLayer(TransformerLayer):
    """An mcore ``TransformerLayer`` with the layer scales ``ls1`` (attention) and ``ls2`` (MLP),
    Megatron-LM's names for transformers' ``lambda_1`` / ``lambda_2``."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.ls1 = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        self.ls2 = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        # The bias-dropout-adds are this class's methods below, which read the scales when they
        # run: a function holding the parameters made here would keep them after a load swaps
        # them (check --low-memory streams each module's weights in that way).
        del self.self_attn_bda, self.mlp_bda

    def self_attn_bda(self, training: bool, fused: bool):
        return _scaled_residual_add(self.ls1, training, fused)

    def mlp_bda(self, training: bool, fused: bool):
        return _scaled_residual_add(self.ls2, training, fused)


def layer_spec(qk_norm: bool, *, column: type = ColumnParallelLinear, row: type = BiasInGemmRowParallelLinear,
               core_attention: type = BidirectionalCoreAttention) -> ModuleSpec:
    """Megatron-LM's InternViT layer (the 6B's with ``qk_norm``, the 300M's without): separate
    norms, bidirectional attention, on local modules, or on the linears and attention given
    (Megatron's class takes Transformer Engine's)."""
    return ModuleSpec(
        module=LayerScaledTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=InternViTNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=QKVLinear if column is ColumnParallelLinear else qkv_linear(column),
                    core_attention=core_attention, linear_proj=row,
                    q_layernorm=WholeWidthQKNorm if qk_norm else None,
                    k_layernorm=WholeWidthQKNorm if qk_norm else None)),
            self_attn_bda=_unused_bda,
            pre_mlp_layernorm=InternViTNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
            mlp_bda=_unused_bda,
        ),
    )


def vision_config(cfg):
    return vision_of(cfg, MODEL_TYPES)


def transformer_config(vc, params_dtype: torch.dtype = torch.float32, **overrides) -> TransformerConfig:
    """The family's recipe with transformers' own activation function."""
    fields = transformer_fields(vc)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **{**fields, **overrides})


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> ViTModel:
    """``ViTModel`` in ``CLIPViTModel``'s InternViT layout from an HF ``InternVLVisionConfig``."""
    vc = vision_config(cfg)
    if not vc.use_absolute_position_embeddings:
        raise ValueError("an InternViT tower without absolute position embeddings is not supported "
                         "(Megatron's CLIPViTModel always has its position table)")
    img_h, img_w = image_hw(vc)
    return ViTModel(transformer_config(vc, params_dtype), layer_spec(bool(vc.use_qk_norm)),
                    patch_dim=first_int(vc.patch_size), img_h=img_h, img_w=img_w,
                    in_channels=vc.num_channels, patch_embed_path="conv1", patch_embed_bias=True,
                    add_class_token=True, class_token_len=CLASS_TOKEN_LEN, ln_pre=False,
                    pos_emb_type="learned_absolute",
                    ln_post=None if vc.use_mean_pooling else "tokens", ln_post_eps=vc.layer_norm_eps,
                    ln_post_kind="LayerNorm")
