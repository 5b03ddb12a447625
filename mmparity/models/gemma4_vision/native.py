"""Native Gemma 4 vision tower on an mcore ``TransformerBlock``.

Reference: transformers 5.24 ``Gemma4VisionModel``. Megatron has no Gemma 4 tower; the layers are
mcore's ``TransformerLayer`` / ``SelfAttention`` / ``MLP`` with what Gemma 4 does differently:

* every RMSNorm (the four per layer, the q/k norms) computes in fp32 and scales by ``weight``,
  not ``1 + weight`` as Gemma 3's text norms do (:func:`gemma_rms_norm`); v is normalised too,
  without a weight (transformers' ``v_norm``, ``with_scale=False``: nothing to store);
* the post-attention and post-feedforward norms sit on the row-parallel linear whose output they
  normalise (``linear_proj.post_layernorm``, ``linear_fc2.post_layernorm``), so the residual add
  follows them as in transformers;
* attention logits are not scaled (``softmax_scale`` 1);
* axial 2D RoPE: a patch at (column x, row y) rotates by x·f and y·f, f[j] = θ^(-4j/hd) for
  j < hd/4, laid out ``[x·f, y·f, x·f, y·f]`` for mcore's rotate-half over the whole head (the
  converter reorders q/k rows to match transformers' rotation of each half by its own axis);
* clipped linears (``use_clipped_linears``): each of q, k, v, o, gate, up, down clamps its input
  and its output to bounds held as buffers (transformers' names; ``linear_qkv`` and
  ``linear_fc1`` hold one set per fused linear, applied to that linear's rows, so they stay exact
  under any TP split);
* the input is the image processor's: patch rows ``(B, max_patches, P·P·C)`` scaled by
  ``2·(x − 0.5)``, a bias-free linear (``patch_embed.proj``), plus the sum of two learned rows
  (``position_embeddings.weight``, ``(2, size, hidden)``: one row per column, one per row).
  Padding rows (position (-1, -1)) are dropped before the layers: the images run as one packed
  sequence, each attending to itself. transformers runs the padding through its layers too but
  masks it out of every key and zeroes it before pooling, so the real patches' outputs are the
  same function;
* after the last layer, each image's patches are averaged over k x k windows of the patch grid
  (k = ``pooling_kernel_size``; window of patch (x, y): ``x // k + (W // k)·(y // k)``, W the
  image's width in patches), in fp32, scaled by sqrt(hidden) in fp32, concatenated over the batch,
  and standardized where ``standardize`` (``(x − std_bias)·std_scale``, in fp32), then cast to the
  weights' dtype: transformers' ``last_hidden_state``, what the whole Gemma 4 model reads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmparity.config import first_int, head_dim, rope_theta, vision_of
from mmparity.models.core.attention import BidirectionalCoreAttention
from mmparity.models.core.layers import (
    NormedColumnParallelLinear, activation_from_hf, get_bias_dropout_add, get_pg_size, tolerate_missing_extra_state,
    vision_transformer_config)
from mmparity.models.core.vit import VisionTower
from mmparity.models.gemma4_vision.config import BOUNDS, transformer_fields
from mmparity.parallel import runtime

MODEL_TYPES = ("gemma4_vision",)
# The bounds before a checkpoint sets them: no clamping, as transformers initialises them.
_UNBOUNDED = dict(zip(BOUNDS, (-math.inf, math.inf, -math.inf, math.inf)))


def vision_config(cfg):
    return vision_of(cfg, MODEL_TYPES)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm: in fp32, ``x · (mean(x²) + eps)^-1/2``, times ``weight`` where there is
    one, cast back to ``x``'s dtype. (``pow`` rather than ``rsqrt``, as transformers computes it.)"""
    h = x.float()
    out = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


class GemmaRMSNorm(torch.nn.Module):
    """:func:`gemma_rms_norm` with a ``weight`` (key ``weight``): the q/k norms and the post-norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


def _add_bounds(module: torch.nn.Module, prefixes, dtype: torch.dtype) -> None:
    """The four clamp bounds of each linear ``prefix`` names, as persistent 0-d buffers."""
    for prefix in prefixes:
        for bound, value in _UNBOUNDED.items():
            module.register_buffer(prefix + bound, torch.tensor(value, dtype=dtype))


def _bound(module, prefix: str, bound: str) -> torch.Tensor:
    return getattr(module, prefix + bound)


class ClippedNormedColumnParallelLinear(NormedColumnParallelLinear):
    """``linear_qkv`` / ``linear_fc1``: Gemma's RMSNorm fused in front (``layer_norm_weight``), and,
    where the tower clips its linears, the bounds of each linear fused here (``parts``: ``q``, ``k``,
    ``v`` for ``linear_qkv``, ``gate``, ``up`` for ``linear_fc1``). Each part's rows see the input
    clamped to its own bounds and are clamped to its own output bounds; a TP rank's rows are whole
    query groups (q heads, k, v) or halves of gate and up, so it finds its parts from the layout."""

    def __init__(self, input_size: int, output_size: int, *, config, parts: tuple = (), clipped: bool = False,
                 **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.parts, self.clipped = tuple(parts), clipped
        self._labels = None
        if clipped:
            _add_bounds(self, [f"{p}_" for p in self.parts], config.params_dtype)

    def norm(self, input_: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(input_, self.layer_norm_weight, self.norm_eps)

    def part_labels(self) -> torch.Tensor:
        """The part (index into ``parts``) of each of this rank's output rows."""
        rows = self.weight.shape[0]
        if len(self.parts) == 3:  # [q heads of a group…, k, v] per query group
            cfg = self.config
            d, per = cfg.kv_channels, cfg.num_attention_heads // cfg.num_query_groups
            group = torch.tensor([0] * (per * d) + [1] * d + [2] * d)
            labels = group.repeat(rows // group.numel())
        else:  # [gate; up]
            labels = torch.arange(len(self.parts)).repeat_interleave(rows // len(self.parts))
        if labels.numel() != rows:
            raise ValueError(f"{rows} rows do not split into the parts {self.parts}")
        return labels

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self.clipped:
            return super().forward(input_, weight, runtime_gather_output)
        normed = self.normed(self.norm(input_))
        if get_pg_size(self.tp_group) > 1:
            normed = copy_to_tensor_model_parallel_region(normed, group=self.tp_group)
        if self._labels is None or self._labels[0].device != normed.device:
            labels = self.part_labels()
            # Each part's rows, found once per device (not a host sync in every forward).
            self._labels = (labels.to(normed.device),
                            [(labels == i).nonzero().squeeze(1).to(normed.device) for i in range(len(self.parts))])
        labels, part_rows = self._labels
        out = normed.new_empty(*normed.shape[:-1], self.weight.shape[0])
        for part, rows in zip(self.parts, part_rows):
            clamped = torch.clamp(normed, _bound(self, f"{part}_", "input_min"), _bound(self, f"{part}_", "input_max"))
            out[..., rows] = F.linear(clamped, self.weight[rows])
        low = torch.stack([_bound(self, f"{p}_", "output_min") for p in self.parts])[labels]
        high = torch.stack([_bound(self, f"{p}_", "output_max") for p in self.parts])[labels]
        return torch.clamp(out, low, high), None


class ClippedPostNormedRowParallelLinear(RowParallelLinear):
    """``linear_proj`` / ``linear_fc2``: a row-parallel linear (input clamped first where the
    tower clips, output clamped after the reduction) followed by Gemma's post-norm
    (``post_layernorm``), which reads the reduced output, so every TP rank holds all of it."""

    def __init__(self, input_size: int, output_size: int, *, config, clipped: bool = False, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.clipped = clipped
        self.post_layernorm = GemmaRMSNorm(config, output_size, eps=config.layernorm_epsilon)
        if clipped:
            _add_bounds(self, [""], config.params_dtype)

    def forward(self, input_):
        if self.clipped:
            input_ = torch.clamp(input_, self.input_min, self.input_max)
        out, bias = super().forward(input_)
        if bias is not None:  # Gemma's linears have none; a bias would go before the clamp and the norm
            out = out + bias
        if self.clipped:
            out = torch.clamp(out, self.output_min, self.output_max)
        return self.post_layernorm(out), None


class Gemma4VisionSelfAttention(SelfAttention):
    """mcore's ``SelfAttention`` with v normalised per head, without a weight (transformers'
    ``v_norm``), after the q/k norms mcore applies itself."""

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if isinstance(out, tuple) and len(out) == 3:
            query, key, value = out
            return query, key, gemma_rms_norm(value, None, self.config.layernorm_epsilon)
        return out


def layer_spec(clipped: bool) -> ModuleSpec:
    """A Gemma 4 vision layer: bidirectional attention with q/k/v norms, four norms, clipped linears."""
    attention = ModuleSpec(
        module=Gemma4VisionSelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ModuleSpec(module=ClippedNormedColumnParallelLinear,
                                  params={"parts": ("q", "k", "v"), "clipped": clipped}),
            core_attention=BidirectionalCoreAttention,
            linear_proj=ModuleSpec(module=ClippedPostNormedRowParallelLinear, params={"clipped": clipped}),
            q_layernorm=GemmaRMSNorm, k_layernorm=GemmaRMSNorm))
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=ModuleSpec(module=ClippedNormedColumnParallelLinear,
                              params={"parts": ("gate", "up"), "clipped": clipped}),
        linear_fc2=ModuleSpec(module=ClippedPostNormedRowParallelLinear, params={"clipped": clipped})))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=IdentityOp, mlp=mlp, mlp_bda=get_bias_dropout_add))


class PatchLinear(torch.nn.Module):
    """transformers' ``input_proj``: a bias-free linear over processor rows, held as ``proj``."""

    def __init__(self, in_features: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.proj = torch.nn.Linear(in_features, hidden_size, bias=False, dtype=dtype)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        # transformers feeds its patch linear pixels in [-1, 1]; the processor gives [0, 1].
        rows = 2 * (rows - 0.5)
        return self.proj(rows.to(self.proj.weight.dtype))


class AxisPositionTable(torch.nn.Module):
    """Two learned tables in one ``weight`` ``(2, size, hidden)``: the column's row of the first
    plus the row's row of the second."""

    def __init__(self, size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, size, hidden_size, dtype=dtype))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.weight[0][positions[:, 0]] + self.weight[1][positions[:, 1]]


class Standardize(torch.nn.Module):
    """``(x − bias) · scale`` in fp32 (transformers' ``std_bias`` / ``std_scale`` buffers)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("bias", torch.zeros(hidden_size, dtype=dtype))
        self.register_buffer("scale", torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.bias.float()) * self.scale.float()


def axial_rope(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """(N, 2) (column, row) -> angles (N, 1, 1, head_dim) ``[x·f, y·f, x·f, y·f]`` in fp32, every
    call (a buffer would be rounded by a bf16 cast of the model)."""
    half = head_dim // 2
    freqs = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half))
    x = positions[:, 0, None].float() * freqs
    y = positions[:, 1, None].float() * freqs
    return torch.cat([x, y, x, y], dim=-1)[:, None, None, :]


def pool_windows(hidden: torch.Tensor, positions: torch.Tensor, seqlens: list, slots: int, k: int) -> torch.Tensor:
    """Each image's packed tokens averaged over k x k windows by position (fp32 sums, cast back),
    the windows an image fills concatenated over the batch -> (Σ windows, hidden)."""
    if k == 1:  # nothing to pool: the patches as they come (transformers 5.24 keeps its padding here)
        return hidden
    out = []
    for tokens, where in zip(hidden.split(seqlens), positions.split(seqlens)):
        width = int(where[:, 0].max()) + 1
        window = where[:, 0] // k + (width // k) * (where[:, 1] // k)
        if int(window.max()) >= slots:
            raise ValueError(f"patch positions reach window {int(window.max())}; the batch has {slots} "
                             f"per image (max_patches / {k}²)")
        sums = torch.zeros(slots, tokens.shape[-1], dtype=torch.float32, device=tokens.device)
        sums.index_add_(0, window, tokens.float())
        filled = torch.zeros(slots, dtype=torch.bool, device=tokens.device)
        filled[window] = True
        out.append((sums / (k * k))[filled].to(tokens.dtype))
    return torch.cat(out)


class Gemma4VisionTower(VisionTower):
    """Processor rows ``(B, max_patches, P·P·C)`` and positions ``(B, max_patches, 2)`` ->
    the soft tokens ``(Σ tokens, hidden)`` on the last pipeline stage (module doc)."""

    def __init__(self, transformer_config, transformer_layer_spec, *, vc):
        super().__init__(config=transformer_config)
        cfg = transformer_config
        self.patch_dim = first_int(vc.patch_size)
        self.pooling = vc.pooling_kernel_size
        self.head_dim, self.theta = head_dim(vc), rope_theta(vc, 100.0)
        if self.head_dim % 4:
            raise ValueError(f"Gemma 4's axial RoPE needs a head_dim divisible by 4, got {self.head_dim}")
        self.pre_process, self.post_process = runtime.is_first_stage(), runtime.is_last_stage()
        self.patch_embed = self.position_embeddings = self.standardize = None
        if self.pre_process:
            self.patch_embed = PatchLinear(3 * self.patch_dim ** 2, cfg.hidden_size, cfg.params_dtype)
            self.position_embeddings = AxisPositionTable(vc.position_embedding_size, cfg.hidden_size,
                                                         cfg.params_dtype)
        self.decoder = TransformerBlock(config=cfg, spec=transformer_layer_spec, post_layer_norm=False,
                                        pre_process=self.pre_process, post_process=self.post_process)
        if self.post_process and vc.standardize:
            self.standardize = Standardize(cfg.hidden_size, cfg.params_dtype)
        tolerate_missing_extra_state(self)

    def forward(self, pixel_values: torch.Tensor, pixel_position_ids: torch.Tensor) -> torch.Tensor:
        valid = ~(pixel_position_ids == -1).all(dim=-1)
        positions = pixel_position_ids[valid]
        seqlens = valid.sum(dim=-1).tolist()
        if 0 in seqlens:
            raise ValueError("an image of the batch has no patches (every position is (-1, -1))")
        rope = axial_rope(positions, self.head_dim, self.theta)
        tokens = None
        if self.pre_process:
            tokens = self.patch_embed(pixel_values[valid]) + self.position_embeddings(positions)
            tokens = tokens.unsqueeze(0)
        hidden = self.run_stack(tokens, rope, seqlens)
        if not self.post_process:
            return hidden
        slots = pixel_values.shape[-2] // self.pooling ** 2
        pooled = pool_windows(hidden[0], positions, seqlens, slots, self.pooling)
        # The sqrt(hidden) scale and the standardization in fp32 (the scale can leave fp16's range).
        pooled = pooled.float() * self.config.hidden_size ** 0.5
        if self.standardize is not None:
            pooled = self.standardize(pooled)
        return pooled.to(self.config.params_dtype)


def transformer_config(vc, params_dtype: torch.dtype = torch.float32, **overrides):
    fields = transformer_fields(vc)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **{**fields, **overrides})


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Gemma4VisionTower:
    """The tower from an HF ``Gemma4VisionConfig`` (or a whole Gemma 4 config holding one)."""
    vc = vision_config(cfg)
    return Gemma4VisionTower(transformer_config(vc, params_dtype), layer_spec(bool(vc.use_clipped_linears)), vc=vc)
