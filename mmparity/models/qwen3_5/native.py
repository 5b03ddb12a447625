"""Native Qwen3.5-MoE VL vision tower (``QwenVLViTModel``) on an mcore ``TransformerBlock``.

Reference: transformers 5.24 ``Qwen3_5MoeVisionModel``. Conv3d patch embedding, a learned (g², H)
position table resampled bilinearly (align_corners=True) to each image's patch grid, 2D RoPE in
rotate-half layout, pre-norm LayerNorm blocks with biases and a plain (non-gated) MLP, and a
2×2 "patch merger" (LayerNorm per token, 2×2 grouping to 4H, fc1, erf GELU, fc2).

Token order is block-first everywhere: the m×m patches of one merge block are consecutive and
blocks follow in raster order. The HF image processor already emits its rows in that order, so
packed (pre-patchified) input is taken as is; static ``(B, C, H, W)`` pixels are reordered after
the patch embedding. Position embedding and RoPE are evaluated at the block-first (row, col) ids,
so nothing is reordered twice.

API follows Megatron-LM ``megatron/core/models/vision/vit_model.py``. Deliberate deviations:

* No cap on the image size. RoPE angles are computed from the ids (no table), and the position
  embedding resamples to any grid, larger than the learned table included — as HF does. ``img_h``
  / ``img_w`` are only the nominal size (``num_patches_per_image``). Upstream sizes a RoPE table
  from them and indexes past it for larger images.
* The merger's GELU is exact (erf), as HF's ``nn.GELU()``; the upstream docstring and code use tanh.
* Packed input gets per-image attention by default (``make_packed_seq_params``); upstream runs a
  packed sequence without ``packed_seq_params`` as one image, so images attend to each other.
* Pre-patchified rows are block-first in both accepted widths (C·T·P·P and C·P·P); upstream reads
  single-frame rows as raster order. One rule for both widths, and the processor's order.
* The merger's linears are mcore column/row-parallel layers (sharded under TP) and take part in
  ``forward`` of the merger; upstream keeps them as frozen, replicated ``nn.Linear`` appendages.
  ``QwenPatchMerger`` takes the ``TransformerConfig`` for that reason.
* ``QwenVL2DRotaryEmbedding`` has no ``max_patches_per_side`` (nothing to cap).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.models.core.attention import head_width
from mmparity.models.core.layers import (
    activation_from_hf, tolerate_missing_extra_state, vision_layer_spec, vision_transformer_config)
from mmparity.models.core.vit import ImageSizes, VisionTower, _dynamic_patch_grid_lists, check_image_size
from mmparity.config import rope_theta
from mmparity.models.qwen3_5.config import NORM_EPS as QWEN_NORM_EPS, transformer_fields
from mmparity.parallel import runtime

Grid = Tuple[int, int]
GridArg = Union[int, Sequence[int]]


# --- block-first order ---------------------------------------------------------------------------

def check_grid(h_patches: int, w_patches: int, merge: int) -> None:
    if h_patches <= 0 or w_patches <= 0 or h_patches % merge or w_patches % merge:
        raise ValueError(f"patch grid {h_patches}x{w_patches} is not a positive multiple of "
                         f"spatial_merge_size={merge} on both sides (image sides must be multiples "
                         f"of patch_size*spatial_merge_size)")


def block_first(x: torch.Tensor, h_patches: int, w_patches: int, merge: int) -> torch.Tensor:
    """(B, h·w, ...) tokens in raster order -> the same tokens block-first."""
    check_grid(h_patches, w_patches, merge)
    b, rest = x.shape[0], x.shape[2:]
    grid = x.reshape(b, h_patches // merge, merge, w_patches // merge, merge, *rest)
    # (bh, mh, bw, mw) -> (bh, bw, mh, mw)
    return grid.transpose(2, 3).reshape(b, h_patches * w_patches, *rest)


def block_first_ids(h_patches: int, w_patches: int, merge: int, device=None
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch of an h×w grid, listed block-first: two (h·w,) int64 tensors."""
    check_grid(h_patches, w_patches, merge)
    bh, bw = h_patches // merge, w_patches // merge
    rows = torch.arange(h_patches, device=device).view(bh, 1, merge, 1).expand(bh, bw, merge, merge)
    cols = torch.arange(w_patches, device=device).view(1, bw, 1, merge).expand(bh, bw, merge, merge)
    return rows.reshape(-1), cols.reshape(-1)


def _as_grids(h_patches: GridArg, w_patches: GridArg) -> List[Grid]:
    """Ints (one grid, any batch) or equal-length sequences (the images of one packed sequence)."""
    if isinstance(h_patches, int) and isinstance(w_patches, int):
        return [(h_patches, w_patches)]
    if isinstance(h_patches, int) or isinstance(w_patches, int) or len(h_patches) != len(w_patches):
        raise ValueError("h_patches and w_patches must both be ints or sequences of equal length")
    return [(int(h), int(w)) for h, w in zip(h_patches, w_patches)]


# --- modules -------------------------------------------------------------------------------------

class QwenPatchEmbedding(torch.nn.Module):
    """Conv3d patch embedding (``patch_embed.proj.*``) over (T, P, P) tubelets.

    Pixels ``(B, C, H, W)`` -> ``((B, h·w, hidden) in raster order, h, w)``. Rows ``(…, D)`` ->
    ``(…, hidden)`` where D is C·T·P·P (the HF processor's rows, flattened (C, T, P, P)) or C·P·P
    (one frame, standing for that frame repeated T times).
    """

    def __init__(self, in_channels: int, hidden_size: int, patch_dim: int, temporal_patch_size: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_channels, self.patch_dim = in_channels, patch_dim
        self.temporal_patch_size = temporal_patch_size
        kernel = (temporal_patch_size, patch_dim, patch_dim)
        self.proj = torch.nn.Conv3d(in_channels, hidden_size, kernel_size=kernel, stride=kernel,
                                    bias=True, dtype=dtype)

    def frame_weight(self) -> torch.Tensor:
        """(hidden, C, P, P): the kernel seen by a still image.

        A still image is its frame repeated T times, so summing the kernel over T gives the same
        map at 1/T of the cost. Summed in fp32 so that a low-precision kernel is rounded once.
        """
        weight = self.proj.weight
        return weight.float().sum(dim=2).to(weight.dtype)

    def forward(self, x: torch.Tensor):
        """Hooks (divergence localisation) see both paths because both go through ``__call__``."""
        if x.dim() in (2, 3):
            return self.forward_patches(x)
        if x.dim() != 4:
            raise ValueError(f"expected pixels (B, C, H, W) or patch rows (B, N, D); got shape "
                             f"{tuple(x.shape)}")
        check_image_size(x.shape[-2], x.shape[-1], self.patch_dim)
        weight = self.frame_weight()
        out = F.conv2d(x.to(weight.dtype), weight, self.proj.bias, stride=self.patch_dim)
        _, _, h_patches, w_patches = out.shape
        return out.flatten(2).transpose(1, 2), h_patches, w_patches

    def forward_patches(self, x: torch.Tensor) -> torch.Tensor:
        c, t, p = self.in_channels, self.temporal_patch_size, self.patch_dim
        full, frame = c * t * p * p, c * p * p
        if x.shape[-1] == full:
            weight = self.proj.weight.flatten(1)
        elif x.shape[-1] == frame:
            weight = self.frame_weight().flatten(1)
        else:
            raise ValueError(
                f"patch rows must be C*T*P*P = {c}*{t}*{p}*{p} = {full} wide (HF processor rows, "
                f"flattened (C, T, P, P)) or C*P*P = {frame} wide (one frame); got {x.shape[-1]}")
        return F.linear(x.to(weight.dtype), weight, self.proj.bias)


class QwenLearnedPosEmbed(torch.nn.Module):
    """A learned (g·g, hidden) table (``pos_embed.weight``), resampled bilinearly to any grid.

    Bilinear with align_corners=True: patch (i, j) of an h×w grid reads the table at
    (i·(g-1)/(h-1), j·(g-1)/(w-1)), so grid corners hit table corners whatever the grid size,
    larger than g included. Computed in fp32 (as HF 5.24 does) and returned in fp32.
    """

    def __init__(self, num_grid_per_side: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_grid_per_side = num_grid_per_side
        self.weight = torch.nn.Parameter(
            torch.empty(num_grid_per_side * num_grid_per_side, hidden_size, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=0.02)

    def _taps(self, ids: torch.Tensor, size: int):
        g = self.num_grid_per_side
        # Same float32 expression order as HF, so the source coordinates round identically.
        src = ids.to(torch.float32) * (g - 1) / max(size - 1, 1)
        floor = src.floor()
        frac = src - floor
        lo = floor.long()
        hi = (lo + 1).clamp(max=g - 1)
        # The hat kernel 1 - |distance| for both taps (not `frac` for the upper one): rounds as HF's.
        return (lo, hi), (1 - frac, 1 - (frac - 1).abs())

    def lookup(self, row_ids: torch.Tensor, col_ids: torch.Tensor, h_patches: int,
               w_patches: int) -> torch.Tensor:
        """Embeddings (N, hidden) fp32 at patch ids (N,) of an ``h_patches`` × ``w_patches`` grid."""
        g = self.num_grid_per_side
        (r0, r1), (wr0, wr1) = self._taps(row_ids, h_patches)
        (c0, c1), (wc0, wc1) = self._taps(col_ids, w_patches)
        index = torch.stack([r0 * g + c0, r0 * g + c1, r1 * g + c0, r1 * g + c1], dim=1)
        weights = torch.stack([wr0 * wc0, wr0 * wc1, wr1 * wc0, wr1 * wc1], dim=1)
        table = self.weight.float()
        return (table[index] * weights[..., None]).sum(dim=1)

    def forward(self, h_patches: int, w_patches: int, device=None) -> torch.Tensor:
        """(h·w, hidden) fp32 embeddings in raster order."""
        device = device if device is not None else self.weight.device
        rows = torch.arange(h_patches, device=device).repeat_interleave(w_patches)
        cols = torch.arange(w_patches, device=device).repeat(h_patches)
        return self.lookup(rows, cols, h_patches, w_patches)


class QwenVL2DRotaryEmbedding(torch.nn.Module):
    """2D RoPE angles for patch ids, in mcore's ``rotary_pos_emb`` format (N, 1, 1, head_dim).

    inv[k] = θ^(-2k/(hd/2)) for k < hd/4; angles [row·inv ‖ col·inv] duplicated to fill the head,
    applied rotate-half (``rotary_interleaved=False``) — the same layout as HF, so q/k weights
    need no permutation.
    """

    def __init__(self, head_dim: int, rope_theta: float = 10000.0):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"Qwen 2D RoPE needs a head_dim divisible by 4, got {head_dim}")
        self.head_dim = head_dim
        spatial = head_dim // 2
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` would round a buffer, and the
        # angles grow with the position. Computed on the CPU in fp32, exactly as HF does.
        exponents = torch.arange(0, spatial, 2, dtype=torch.float32) / spatial
        self.inv_freq = 1.0 / (rope_theta ** exponents)
        self._inv_on: dict = {}  # one host-to-device copy per device, not one per image

    def forward(self, row_ids: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
        inv = self._inv_on.get(row_ids.device)
        if inv is None:
            inv = self._inv_on[row_ids.device] = self.inv_freq.to(row_ids.device)
        half = torch.cat([row_ids.float()[:, None] * inv, col_ids.float()[:, None] * inv], dim=-1)
        return torch.cat([half, half], dim=-1)[:, None, None, :]


class QwenPatchMerger(MegatronModule):
    """HF's ``Qwen3_5MoeVisionPatchMerger`` (post-shuffle norm off) in mcore layers.

    ``encoder_tokens``: LayerNorm per token, then each m×m block (consecutive in block-first order)
    becomes one vector of width m²·H, patch-major [top-left ‖ top-right ‖ bottom-left ‖
    bottom-right]. ``project``: fc1, exact GELU, fc2, plain ``nn.Linear``s whole on every TP rank
    (computed redundantly), as Megatron's ``QwenPatchMerger`` keeps them.
    ``forward`` = both: HF's ``pooler_output``.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, spatial_merge_size: int,
                 out_hidden_size: int, eps: float = QWEN_NORM_EPS):
        # Its plain submodules are declared replicated by mcore's sharded_state_dict(): whole on
        # every rank in torch_dist too, as in Megatron's QwenPatchMerger.
        super().__init__(config=config)
        self.hidden_size, self.spatial_merge_size = hidden_size, spatial_merge_size
        merged = hidden_size * spatial_merge_size ** 2
        self.patch_norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        self.linear_fc1 = torch.nn.Linear(merged, merged, bias=True, dtype=config.params_dtype)
        self.linear_fc2 = torch.nn.Linear(merged, out_hidden_size, bias=True, dtype=config.params_dtype)

    def encoder_tokens(self, x: torch.Tensor, h_patches: GridArg, w_patches: GridArg) -> torch.Tensor:
        """(B, N, H) block-first -> (B, N/m², m²·H); grid sequences describe one packed sequence."""
        m = self.spatial_merge_size
        grids = _as_grids(h_patches, w_patches)
        for h, w in grids:
            check_grid(h, w, m)
        total = sum(h * w for h, w in grids)
        if x.dim() != 3 or x.shape[1] != total or (len(grids) > 1 and x.shape[0] != 1):
            raise ValueError(f"merger input {tuple(x.shape)} does not hold the {total} tokens of "
                             f"grid(s) {grids} (packed grids need batch 1)")
        # Block-first order makes every m² consecutive tokens one block: no per-image split.
        x = self.patch_norm(x)
        return x.reshape(x.shape[0], total // (m * m), m * m * self.hidden_size)

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(tokens)))  # erf GELU, as HF's nn.GELU()

    def forward(self, x: torch.Tensor, h_patches: GridArg, w_patches: GridArg) -> torch.Tensor:
        return self.project(self.encoder_tokens(x, h_patches, w_patches))


class QwenVLViTModel(VisionTower):
    """Native Qwen3.5-MoE VL vision encoder.

    Static input: pixels ``(B, C, H, W)`` (one size per batch). Dynamic input: pre-patchified rows
    ``(1, ΣN, D)`` or ``(ΣN, D)``, block-first per image as the HF processor emits them, plus
    ``imgs_sizes`` (pixel (H, W) per image); the images run as one packed sequence in which each
    attends only to itself. Each image is one temporal patch (grid_t = 1).

    ``forward`` returns the pre-projector tokens ``(B, N/m², m²·H)`` (merger norm + grouping);
    ``merger(hidden, h, w)`` on ``encode``'s output gives HF's ``pooler_output``.
    """

    def __init__(self, transformer_config: TransformerConfig, transformer_layer_spec,
                 patch_dim: int = 16, temporal_patch_size: int = 2, img_h: int = 768,
                 img_w: int = 768, in_channels: int = 3, spatial_merge_size: int = 2,
                 out_hidden_size: int = 2048, num_pos_per_side: int = 48,
                 rope_theta: float = 10000.0, pg_collection=None, vp_stage: Optional[int] = None):
        super().__init__(config=transformer_config)
        cfg = transformer_config
        self.patch_dim, self.temporal_patch_size = patch_dim, temporal_patch_size
        self.spatial_merge_size = spatial_merge_size
        self.img_h, self.img_w = img_h, img_w
        self.hidden_size = cfg.hidden_size
        self.out_hidden_size = cfg.hidden_size * spatial_merge_size ** 2
        self.pre_process = runtime.is_first_stage()
        self.post_process = runtime.is_last_stage()
        self.patch_embed = self.pos_embed = None
        if self.pre_process:
            self.patch_embed = QwenPatchEmbedding(in_channels, cfg.hidden_size, patch_dim,
                                                  temporal_patch_size, cfg.params_dtype)
            self.pos_embed = QwenLearnedPosEmbed(num_pos_per_side, cfg.hidden_size, cfg.params_dtype)
        head_dim = head_width(cfg)
        self.rotary_pos_emb = QwenVL2DRotaryEmbedding(head_dim, rope_theta)
        self.decoder = TransformerBlock(config=cfg, spec=transformer_layer_spec,
                                        post_layer_norm=False, pre_process=self.pre_process,
                                        post_process=self.post_process,
                                        pg_collection=pg_collection, vp_stage=vp_stage)
        self.merger = (QwenPatchMerger(cfg, cfg.hidden_size, spatial_merge_size, out_hidden_size)
                       if self.post_process else None)
        tolerate_missing_extra_state(self)

    def patch_grids(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes] = None):
        """The input checked against the patch and merge sizes -> (input, grids, seqlens): a static
        batch of pixels ``(B, C, H, W)`` has one grid and no seqlens; pre-patchified rows
        (``(1, ΣN, D)``, or ``(ΣN, D)``, returned 3-D) a grid and a patch count per image."""
        m = self.spatial_merge_size
        if imgs_sizes is None:
            if pixel_values.dim() != 4:
                raise ValueError("pre-patchified rows need imgs_sizes (pixel (H, W) per image); "
                                 f"got shape {tuple(pixel_values.shape)} without it")
            check_image_size(pixel_values.shape[-2], pixel_values.shape[-1], self.patch_dim)
            h, w = pixel_values.shape[-2] // self.patch_dim, pixel_values.shape[-1] // self.patch_dim
            check_grid(h, w, m)
            return pixel_values, [(h, w)], None
        if pixel_values.dim() == 2:
            pixel_values = pixel_values.unsqueeze(0)
        if pixel_values.dim() != 3 or pixel_values.shape[0] != 1:
            raise ValueError("dynamic input must be pre-patchified rows (1, ΣN, D) or (ΣN, D); "
                             f"got shape {tuple(pixel_values.shape)}")
        grids, seqlens = _dynamic_patch_grid_lists(imgs_sizes, self.patch_dim)
        for h, w in grids:
            check_grid(h, w, m)
        if pixel_values.shape[1] != sum(seqlens):
            raise ValueError(f"imgs_sizes describe {sum(seqlens)} patches but the input has "
                             f"{pixel_values.shape[1]} rows")
        return pixel_values, grids, seqlens

    def embed(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes] = None):
        """-> (tokens (B, N, H) block-first with position embedding, rotary (N, 1, 1, d), grids,
        seqlens or None). Off the first pipeline stage ``tokens`` is None: grids and RoPE follow
        from the input's shape, the embedding weights live on the first stage."""
        m = self.spatial_merge_size
        pixel_values, grids, seqlens = self.patch_grids(pixel_values, imgs_sizes)
        tokens = None
        if self.pre_process:
            tokens = self.patch_embed(pixel_values)
            if seqlens is None:
                tokens = block_first(tokens[0], *grids[0], m)
        device = pixel_values.device
        pos, rope = [], []
        for h, w in grids:
            rows, cols = block_first_ids(h, w, m, device)
            if self.pre_process:
                pos.append(self.pos_embed.lookup(rows, cols, h, w))
            rope.append(self.rotary_pos_emb(rows, cols))
        rope_t = rope[0] if len(rope) == 1 else torch.cat(rope, dim=0)
        if tokens is not None:
            pos_t = pos[0] if len(pos) == 1 else torch.cat(pos, dim=0)
            tokens = tokens + pos_t.to(tokens.dtype)
        return tokens, rope_t, grids, seqlens

    def encode(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
               imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None):
        """The transformer stack: -> (hidden (B, N, H) block-first, h_patches, w_patches).

        ``h_patches``/``w_patches`` are ints for static input and per-image lists for packed input,
        ready for ``merger.encoder_tokens`` / ``merger``.
        """
        tokens, rope, grids, seqlens = self.embed(pixel_values, imgs_sizes)
        hidden = self.run_stack(tokens, rope, seqlens, attention_mask, packed_seq_params)
        if seqlens is None:
            return hidden, grids[0][0], grids[0][1]
        return hidden, [h for h, _ in grids], [w for _, w in grids]

    def forward(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None) -> torch.Tensor:
        hidden, h_patches, w_patches = self.encode(pixel_values, attention_mask, imgs_sizes,
                                                   packed_seq_params)
        if not self.post_process:
            return hidden
        return self.merger.encoder_tokens(hidden, h_patches, w_patches)


# --- construction from the HF config ---------------------------------------------------------------

def _int(value) -> int:
    return value if isinstance(value, int) else int(value[0])


def table_side(cfg) -> int:
    """g of the learned g×g position table; a table that is not a square is refused."""
    n = cfg.num_position_embeddings
    g = int(round(n ** 0.5))
    if g * g != n:
        raise ValueError(f"num_position_embeddings={n} is not a perfect square; the position table "
                         f"must be g*g (HF would silently ignore the rows past {int(n ** 0.5) ** 2})")
    return g



def transformer_config(cfg, params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """The family's recipe (:func:`~mmparity.models.qwen3_5.config.transformer_fields`) with HF's
    own activation function."""
    fields = transformer_fields(cfg)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **fields)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> QwenVLViTModel:
    """``QwenVLViTModel`` from an HF ``Qwen3_5MoeVisionConfig``."""
    g, p = table_side(cfg), _int(cfg.patch_size)
    return QwenVLViTModel(transformer_config(cfg, params_dtype), vision_layer_spec(),
                          patch_dim=p, temporal_patch_size=_int(cfg.temporal_patch_size),
                          img_h=g * p, img_w=g * p, in_channels=cfg.in_channels,
                          spatial_merge_size=cfg.spatial_merge_size,
                          out_hidden_size=cfg.out_hidden_size, num_pos_per_side=g,
                          rope_theta=rope_theta(cfg))
