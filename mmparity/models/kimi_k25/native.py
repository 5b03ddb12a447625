"""Native Kimi-K2.5 MoonViT and its multimodal projector on an mcore ``TransformerBlock``.

Follows the API of Megatron-LM ``megatron/core/models/vision/vit_model.py`` (``Kimi2DRotaryEmbedding``,
``KimiLearned2DPosEmbed``, ``KimiPatchMerger``, ``KimiViTModel``). The parity reference is
transformers 5.24 ``Kimi_K25VisionModel`` + ``Kimi_K25MultimodalProjection``.

Pipeline: Conv2d patch embedding (bias) -> learned 2D position table, bicubically resampled to the
grid (plus a sin‖cos temporal row per frame for clips) -> LayerNorm blocks with biases, tanh GELU
and interleaved 2D RoPE -> final LayerNorm -> 2x2 grouping, mean over a clip's frames
-> ``(B, N/4, 4H)``. :class:`KimiViTWithProjector` appends the projector (LayerNorm over H on each
of the 4 sub-tokens, Linear 4H->4H, erf GELU, Linear 4H->text hidden).

Module names are Megatron's, so the converter's mcore state dict loads here as is: the tower's
``patch_embed.proj``, ``pos_embed``, ``decoder`` (no final norm inside) and ``final_ln``; with a
projector, ``LLaVAModel``'s tree (``vision_model.`` + ``vision_projection.encoder.linear_fc1/fc2``,
``MultimodalProjector('mlp')`` with a fused norm in ``linear_fc1``). That fused norm's m²H weight
and bias hold Kimi's H-sized ones tiled m² times (the converter's ``TileBlocks``);
:class:`SubTokenNormedColumnParallelLinear` applies them per sub-token, which is Kimi's function,
where Megatron's own module normalises the whole merged vector.

Deliberate deviations from that module:

- Video clips (T > 1 frames per item) are supported the way HF 5.24 runs them: every frame of a
  clip adds the temporal row of its index (frame 0 adds sin(0)‖cos(0) = [0…0, 1…1], not nothing),
  one attention segment spans the whole clip, and the merger averages each 2x2 block over the
  frames. The seed skips the temporal term and only handles T = 1.
- RoPE angles are computed from the patch ids, with no table: upstream's cap (``img_h // patch``,
  64 for Kimi) would refuse grids that HF and the release model accept. ``max_patches_per_side``
  is an optional bound that raises instead of clamping.
- The RoPE inverse frequencies and the temporal sin‖cos rows are plain fp32 tensors, not module
  buffers, so a ``.to(bfloat16)`` of the model does not round them (HF's buffers are rounded).
- Grids that the 2x2 merger cannot tile (odd h or w) are refused with a message; HF's
  ``temporal_merge`` silently adds the odd row/column into neighbouring merged tokens (or past
  the item's end, into the next item's).
"""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.config import has_vision_sub_config as has_projector
from mmparity.config import vision_sub_config as vision_cfg
from mmparity.models.core.attention import head_width, make_packed_seq_params
from mmparity.models.core.layers import (
    NormedColumnParallelLinear, activation_from_hf, layer_norm, tolerate_missing_extra_state, vision_layer_spec,
    vision_transformer_config)
from mmparity.models.core.vit import (
    ImageSizes, TowerWithProjection, VisionTower, PatchEmbedding, VisionNorm, _dynamic_patch_grid_lists,
    check_image_size)
from mmparity.config import rope_theta
from mmparity.models.kimi_k25.config import projection_fields, transformer_fields
from mmparity.parallel import runtime

Grid = Tuple[int, int]


def _grid_ids(h_patches: int, w_patches: int, num_frames: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Raster (row, col) ids of one frame, repeated for every frame of a clip."""
    rows = torch.arange(h_patches, device=device).repeat_interleave(w_patches).repeat(num_frames)
    cols = torch.arange(w_patches, device=device).repeat(h_patches * num_frames)
    return rows, cols


# --- the packed layout: every per-token index of a batch, built once on the host -----------------
#
# A packed batch of items of different sizes needs, per token, its (row, col) for the RoPE angles,
# its bicubic taps into the learned position table, its frame for the temporal rows, and where the
# 2x2 merger takes it. Built per image that was a Python loop of small tensor ops (and a host-to-
# device copy of the RoPE frequencies per image, which synchronises a CUDA device). Here they are
# computed for all items at once, on the host, in a fixed number of vectorised ops, moved with one
# asynchronous copy each, and cached per layout: the forward's op count does not depend on the
# number of images, and a repeated layout costs no index work at all.

# Keys' cubic convolution kernel with a = -0.75: the one ``F.interpolate(mode="bicubic")`` uses.
_CUBIC_A = -0.75


def _cubic_near(x: torch.Tensor) -> torch.Tensor:
    """Kernel weight at distance |x| <= 1."""
    a = _CUBIC_A
    return ((a + 2) * x - (a + 3)) * x * x + 1


def _cubic_far(x: torch.Tensor) -> torch.Tensor:
    """Kernel weight at distance 1 < |x| < 2."""
    a = _CUBIC_A
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a


def _bicubic_axis(dst: torch.Tensor, out_size: torch.Tensor, in_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output position ``dst`` of an axis resampled from ``in_size`` to ``out_size`` (both per
    token): the 4 source taps (clamped to the border) and their fp32 weights, ``align_corners=False``.
    """
    scale = torch.full(dst.shape, float(in_size), dtype=torch.float32) / out_size.to(torch.float32)
    src = scale * (dst.to(torch.float32) + 0.5) - 0.5
    base = torch.floor(src)
    t = src - base
    taps = (base.to(torch.int64)[:, None] + torch.arange(-1, 3)).clamp_(0, in_size - 1)
    weights = torch.stack([_cubic_far(t + 1), _cubic_near(t), _cubic_near(1 - t), _cubic_far(2 - t)], dim=1)
    return taps, weights


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "cuda":
        # From pinned memory the copy is asynchronous; from pageable memory CUDA copies synchronously.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _cached_on(cache: dict, tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device``, copied there once and kept in ``cache`` (device name -> copy)."""
    key = str(device)
    found = cache.get(key)
    if found is None:
        found = cache[key] = _to_device(tensor, key)
    return found


class _TokenIds(NamedTuple):
    """Host int64 tensors, one entry per token of a packed batch (items frame-major, raster order)."""

    item_h: torch.Tensor  # the item's grid height
    item_w: torch.Tensor  # and width
    item_t: torch.Tensor  # and frame count
    start: torch.Tensor   # the item's first token
    local: torch.Tensor   # index inside the item
    frame: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


@functools.lru_cache(maxsize=16)
def _host_token_ids(grids: Tuple[Grid, ...], frames: Tuple[int, ...]) -> _TokenIds:
    sizes = [t * h * w for (h, w), t in zip(grids, frames)]
    counts, total = torch.tensor(sizes, dtype=torch.int64), sum(sizes)

    def per_token(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64).repeat_interleave(counts, output_size=total)

    h, w, t = per_token([g[0] for g in grids]), per_token([g[1] for g in grids]), per_token(frames)
    start = per_token(counts.cumsum(0) - counts)
    local = torch.arange(total) - start
    frame, in_frame = local // (h * w), local % (h * w)
    return _TokenIds(h, w, t, start, local, frame, in_frame // w, in_frame % w)


@functools.lru_cache(maxsize=16)
def packed_patch_ids(grids: Tuple[Grid, ...], frames: Tuple[int, ...], device: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) int64 patch ids of every token of a packed batch, on ``device``."""
    ids = _host_token_ids(grids, frames)
    return _to_device(ids.rows, device), _to_device(ids.cols, device)


@functools.lru_cache(maxsize=16)
def packed_bicubic_taps(grids: Tuple[Grid, ...], frames: Tuple[int, ...], table: Grid, device: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's 16 bicubic taps into a flattened ``table`` (int32 ``(ΣN, 16)``) and their fp32
    weights: the separable 4x4 kernel of ``F.interpolate(mode="bicubic", align_corners=False)``,
    borders clamped, no antialias. At the table's own size the weights are exactly 1 and 0."""
    ids = _host_token_ids(grids, frames)
    ty, wy = _bicubic_axis(ids.rows, ids.item_h, table[0])
    tx, wx = _bicubic_axis(ids.cols, ids.item_w, table[1])
    taps = (ty[:, :, None] * table[1] + tx[:, None, :]).flatten(1).to(torch.int32)
    weights = (wy[:, :, None] * wx[:, None, :]).flatten(1)
    return _to_device(taps, device), _to_device(weights, device)


@functools.lru_cache(maxsize=16)
def packed_time_rows(grids: Tuple[Grid, ...], frames: Tuple[int, ...], device: str) -> torch.Tensor:
    """Per token, its row in a temporal table whose row 0 is zero: 0 in a still image, 1 + frame in a clip."""
    ids = _host_token_ids(grids, frames)
    return _to_device(torch.where(ids.item_t > 1, ids.frame + 1, torch.zeros_like(ids.frame)), device)


@functools.lru_cache(maxsize=16)
def packed_merge_order(grids: Tuple[Grid, ...], merge: int, device: str) -> torch.Tensor:
    """For still images: the token that fills each slot of the merged output, in order.

    Slot s of an item lies in merged token s // m² (row-major over the (h/m, w/m) blocks), at
    sub-position s % m² (row-major over the m x m block)."""
    ids = _host_token_ids(grids, (1,) * len(grids))
    block, sub = ids.local // (merge * merge), ids.local % (merge * merge)
    blocks_w = ids.item_w // merge
    rows = (block // blocks_w) * merge + sub // merge
    cols = (block % blocks_w) * merge + sub % merge
    return _to_device(ids.start + rows * ids.item_w + cols, device)


class Kimi2DRotaryEmbedding(torch.nn.Module):
    """Kimi's 2D RoPE, interleaved (complex-pair) layout: pair 2k rotates by col·f_k, pair 2k+1 by row·f_k.

    f_k = θ^(-4k/hd) for k < hd/4 (the frequencies of a hd/2-wide 1D RoPE, shared by both axes).
    The hd/2 angles ``[c·f0, r·f0, c·f1, r·f1, …]`` are each repeated twice in place, the format
    mcore's ``rotary_interleaved=True`` expects. HF 5.24 lays the same angles out ``[a ‖ a]`` with
    rotate-half on q/k rows it permuted per head when converting from the release.
    """

    def __init__(self, head_dim: int, max_patches_per_side: Optional[int] = None,
                 rope_theta: float = 10000.0):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"Kimi 2D RoPE needs a head_dim divisible by 4, got {head_dim}")
        self.head_dim = head_dim
        self.max_patches_per_side = max_patches_per_side
        # Same fp32 arithmetic as HF's axial init, so the angles agree bit for bit.
        spatial = head_dim // 2
        self._inv_freq = 1.0 / (rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        self._inv_freq_on: dict = {}  # device -> copy: one host-to-device copy per device, not per call

    def angles(self, row_ids: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
        """(N,) ids -> (N, head_dim/2) angles, column first in each pair, not yet repeated."""
        inv = _cached_on(self._inv_freq_on, self._inv_freq, row_ids.device)
        cols = col_ids.to(torch.float32)[:, None] * inv
        rows = row_ids.to(torch.float32)[:, None] * inv
        return torch.stack([cols, rows], dim=-1).flatten(1)

    def forward(self, row_ids: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
        """(N,) ids -> (N, 1, 1, head_dim), mcore's ``rotary_pos_emb`` format."""
        if self.max_patches_per_side is not None and row_ids.numel() and (
                max(int(row_ids.max()), int(col_ids.max())) >= self.max_patches_per_side):
            raise ValueError(f"patch ids reach {max(int(row_ids.max()), int(col_ids.max()))}, beyond "
                             f"max_patches_per_side={self.max_patches_per_side}")
        return self.angles(row_ids, col_ids).repeat_interleave(2, dim=-1)[:, None, None, :]

    def for_grid(self, h_patches: int, w_patches: int, num_frames: int = 1, device=None) -> torch.Tensor:
        return self(*_grid_ids(h_patches, w_patches, num_frames, device))

    def packed(self, grids: Sequence[Grid], frames: Sequence[int], device) -> torch.Tensor:
        """(ΣT·h·w, 1, 1, head_dim) angles of a packed batch, items frame-major, in one batched
        computation (the same ids and arithmetic as :meth:`for_grid` per item, concatenated)."""
        grids = tuple((int(h), int(w)) for h, w in grids)
        if not grids:
            raise ValueError("no items to build RoPE angles for")
        side = max(max(g) for g in grids)
        if self.max_patches_per_side is not None and side - 1 >= self.max_patches_per_side:
            raise ValueError(f"patch ids reach {side - 1}, beyond "
                             f"max_patches_per_side={self.max_patches_per_side}")
        rows, cols = packed_patch_ids(grids, tuple(int(t) for t in frames), str(torch.device(device)))
        return self.angles(rows, cols).repeat_interleave(2, dim=-1)[:, None, None, :]


def temporal_sincos(num_frames: int, dim: int) -> torch.Tensor:
    """(num_frames, dim) rows ``[sin(t·ω) ‖ cos(t·ω)]``, ω_j = 10000^(-2j/dim), in HF's fp32 arithmetic."""
    if dim % 2:
        raise ValueError(f"the temporal sin‖cos embedding needs an even width, got {dim}")
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    freqs = torch.outer(torch.arange(num_frames, dtype=torch.float32), inv)
    return torch.cat([freqs.sin(), freqs.cos()], dim=1)


def check_clip_length(num_frames: int, max_frames: int) -> None:
    if num_frames > max_frames:
        raise ValueError(f"a clip of {num_frames} frames exceeds the temporal table of "
                         f"{max_frames} frames (pos_emb_time)")


class KimiLearned2DPosEmbed(torch.nn.Module):
    """Learned ``(height, width, H)`` position table, bicubically resampled to each grid.

    Identity when the grid equals the table; otherwise ``F.interpolate(mode='bicubic',
    align_corners=False)`` without antialias (antialias would change values by O(1) when
    shrinking), computed as that function's separable Keys a=-0.75 kernel with clamped borders
    written out as 16 weighted taps per patch: one fp32 ``embedding_bag`` over every patch of a
    packed batch, whatever its sizes. ``F.interpolate`` takes one output size per call, and its
    CUDA kernel runs one thread per output pixel that loops over all channels (1152 here), so a
    few thousand threads did the whole resampling, once per image size. The weights are exact at
    the table's own size; elsewhere the sums round differently from ``F.interpolate`` (about 1e-7
    relative in fp32). A clip of T > 1 frames also adds the temporal row of each
    frame's index; a still image adds none.

    ``forward(h, w, device)`` is upstream's API (the ``(h·w, H)`` table); ``forward(tokens, grids,
    frames)`` adds the terms to patch tokens and is what the model calls, so that a forward hook
    sees the embedded tokens.
    """

    def __init__(self, height: int, width: int, hidden_size: int, max_frames: int = 4):
        super().__init__()
        self.height, self.width, self.hidden_size = height, width, hidden_size
        self.max_frames = max_frames
        self.weight = torch.nn.Parameter(torch.empty(height, width, hidden_size))
        torch.nn.init.trunc_normal_(self.weight, std=0.02)
        self._time = temporal_sincos(max_frames, hidden_size)
        self._time_padded = torch.cat([self._time.new_zeros(1, hidden_size), self._time])  # row 0: still images
        self._time_on: dict = {}  # device -> _time_padded there

    def table(self, h_patches: int, w_patches: int) -> torch.Tensor:
        """(h·w, H) resampled table in the weight's dtype."""
        return self.spatial([(h_patches, w_patches)], [1])

    def spatial(self, grids: Sequence[Grid], frames: Sequence[int]) -> torch.Tensor:
        """(ΣT·h·w, H) resampled rows of every patch of a packed batch (every frame of a clip
        repeats its grid's rows), in the weight's dtype, on the weight's device."""
        grids = tuple((int(h), int(w)) for h, w in grids)
        frames = tuple(int(t) for t in frames)
        flat = self.weight.flatten(0, 1)
        if all(g == (self.height, self.width) for g in grids):
            copies = sum(frames)
            return flat if copies == 1 else flat.repeat(copies, 1)
        taps, weights = packed_bicubic_taps(grids, frames, (self.height, self.width), str(flat.device))
        rows = F.embedding_bag(taps, flat.float(), per_sample_weights=weights, mode="sum")
        return rows.to(self.weight.dtype)

    def temporal(self, num_frames: int, device) -> torch.Tensor:
        """(num_frames, H) fp32 rows for a clip; refuses clips longer than the table."""
        check_clip_length(num_frames, self.max_frames)
        return self._time[:num_frames].to(device)

    def positions(self, h_patches: int, w_patches: int, num_frames: int, device) -> torch.Tensor:
        """(T·h·w, H) additive term of one item, frame-major."""
        spatial = self.table(h_patches, w_patches).to(device)
        if num_frames == 1:
            return spatial
        full = spatial.unsqueeze(0) + self.temporal(num_frames, device)[:, None, :]
        return full.flatten(0, 1)

    def forward(self, tokens_or_h, grids_or_w, frames_or_device=None):
        if not isinstance(tokens_or_h, torch.Tensor):
            return self.table(int(tokens_or_h), int(grids_or_w)).to(frames_or_device)
        tokens, grids, frames = tokens_or_h, grids_or_w, frames_or_device
        return tokens + self.packed(grids, frames, tokens.shape[-2]).to(tokens.device, tokens.dtype)

    def packed(self, grids: Sequence[Grid], frames: Sequence[int], tokens: Optional[int] = None
               ) -> torch.Tensor:
        """(ΣT·h·w, H) additive term of a packed batch, items frame-major: :meth:`positions` of
        each item, concatenated, computed for all items at once. Clips make it fp32 (their
        temporal rows are); ``tokens`` is checked against the patch count."""
        frames = [int(t) for t in frames]
        for t in frames:
            check_clip_length(t, self.max_frames)
        total = sum(t * int(h) * int(w) for (h, w), t in zip(grids, frames))
        if tokens is not None and total != tokens:
            raise ValueError(f"grids describe {total} patches but the tokens hold {tokens}")
        pos = self.spatial(grids, frames)
        if all(t == 1 for t in frames):
            return pos
        rows = packed_time_rows(tuple((int(h), int(w)) for h, w in grids), tuple(frames), str(pos.device))
        return pos + _cached_on(self._time_on, self._time_padded, pos.device)[rows]


class KimiPatchMerger(torch.nn.Module):
    """Groups each 2x2 block onto the feature axis: ``(B, T·h·w, H) -> (B, h/2·w/2, 4H)``.

    Blocks are row-major, each vector patch-major ``[top-left ‖ top-right ‖ bottom-left ‖
    bottom-right]``. A clip's T frames are averaged per block (HF's ``temporal_merge``: fp32 sum of
    x/T); at T = 1 this is a pure reshape. No parameters.
    """

    def __init__(self, merge_size: int = 2):
        super().__init__()
        self.merge_size = merge_size

    def _check(self, h_patches: int, w_patches: int) -> None:
        m = self.merge_size
        if h_patches % m or w_patches % m:
            raise ValueError(f"the {m}x{m} patch merger needs a grid divisible by {m}, got "
                             f"{h_patches}x{w_patches} patches (image sides must be multiples of "
                             f"patch_size*{m})")

    def forward(self, x: torch.Tensor, h_patches: int, w_patches: int, num_frames: int = 1) -> torch.Tensor:
        self._check(h_patches, w_patches)
        m = self.merge_size
        batch, tokens, hidden = x.shape
        if tokens != num_frames * h_patches * w_patches:
            raise ValueError(f"{tokens} tokens do not form {num_frames} frame(s) of {h_patches}x{w_patches}")
        blocks = x.view(batch, num_frames, h_patches // m, m, w_patches // m, m, hidden)
        # -> (B, h/m, w/m, T, m, m, H): one row per merged token, frames next to each other.
        blocks = blocks.permute(0, 2, 4, 1, 3, 5, 6)
        if num_frames > 1:
            blocks = (blocks.float() * (1.0 / num_frames)).sum(dim=3).to(x.dtype)
        return blocks.reshape(batch, (h_patches // m) * (w_patches // m), m * m * hidden)

    def merge_packed(self, x: torch.Tensor, grids: Sequence[Grid], frames: Sequence[int]) -> torch.Tensor:
        """Packed ``(1, Σ T·h·w, H)`` -> ``(1, Σ h/2·w/2, 4H)``, items in order.

        Still images only: one gather of every token into its merged slot (the same rows as
        :meth:`forward` per item). With a clip among the items, item by item (frames averaged)."""
        sizes = [t * h * w for (h, w), t in zip(grids, frames)]
        if sum(sizes) != x.shape[1]:
            raise ValueError(f"grids describe {sum(sizes)} patches but the input holds {x.shape[1]}")
        if any(t != 1 for t in frames):
            parts = torch.split(x, sizes, dim=1)
            return torch.cat([self(p, h, w, t) for p, (h, w), t in zip(parts, grids, frames)], dim=1)
        for h, w in grids:
            self._check(h, w)
        m = self.merge_size
        order = packed_merge_order(tuple((int(h), int(w)) for h, w in grids), m, str(x.device))
        return x.index_select(1, order).view(x.shape[0], -1, m * m * x.shape[-1])


class KimiVisionOutput(NamedTuple):
    last_hidden_state: torch.Tensor      # (B, N, H) after the final LayerNorm
    pooler_output: Optional[torch.Tensor]  # (B, M, 4H) merged tokens (None off the last PP stage)
    image_embeds: Optional[torch.Tensor]   # (B, M, text H) when a projector is attached
    grids: List[Grid]
    frames: List[int]


class KimiViTModel(VisionTower):
    """Native mcore MoonViT (Kimi-K2.5 vision tower).

    Inputs:

    - static ``(B, C, H, W)`` images, or ``(B, T, C, H, W)`` clips of T frames each;
    - dynamic: pre-patchified rows ``(1, ΣN, C·P·P)`` (each row flattened (C, P, P), raster order,
      a clip's frames one after another) with ``imgs_sizes`` (pixels, one (H, W) per item) and
      optionally ``num_frames`` (one count per item, default 1). Run as one packed sequence in
      which every item (a whole clip) attends only to itself.

    Returns the merged tokens ``(B, M, 4H)`` (``(1, ΣM, 4H)`` for packed input); :meth:`encode`
    also returns the pre-merge hidden states.
    """

    def __init__(self, transformer_config: TransformerConfig, transformer_layer_spec,
                 patch_dim: int = 14, img_h: int = 896, img_w: int = 896, in_channels: int = 3,
                 pos_embed_height: int = 64, pos_embed_width: int = 64,
                 rope_theta: float = 10000.0, pg_collection=None, vp_stage: Optional[int] = None,
                 *, pos_embed_time: int = 4, merge_size: int = 2,
                 max_patches_per_side: Optional[int] = None):
        super().__init__(config=transformer_config)
        cfg = transformer_config
        self.patch_dim, self.img_h, self.img_w = patch_dim, img_h, img_w
        self.in_channels = in_channels
        self.hidden_size = cfg.hidden_size
        self.max_frames = pos_embed_time
        self.pre_process = runtime.is_first_stage()
        self.post_process = runtime.is_last_stage()
        self.patch_embed = self.pos_embed = None
        if self.pre_process:
            self.patch_embed = torch.nn.Module()
            self.patch_embed.proj = PatchEmbedding(in_channels, cfg.hidden_size, patch_dim, bias=True)
            self.pos_embed = KimiLearned2DPosEmbed(pos_embed_height, pos_embed_width,
                                                   cfg.hidden_size, max_frames=pos_embed_time)
        head_dim = head_width(cfg)
        self.rotary_pos_emb = Kimi2DRotaryEmbedding(head_dim, max_patches_per_side, rope_theta)
        # The final norm sits outside the block, as in Megatron's KimiViTModel (``final_ln``).
        self.decoder = TransformerBlock(config=cfg, spec=transformer_layer_spec,
                                        post_layer_norm=False, pre_process=self.pre_process,
                                        post_process=self.post_process)
        self.final_ln = (VisionNorm(cfg.hidden_size, cfg.layernorm_epsilon, "LayerNorm", cfg.params_dtype)
                         if self.post_process else None)
        # No parameters: every stage keeps it, for the grid checks that precede the transformer.
        self.merger = KimiPatchMerger(merge_size)
        tolerate_missing_extra_state(self)

    def _patch_tokens(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes],
                      num_frames: Optional[Sequence[int]]):
        """-> (tokens (B, N, H), or None off the first pipeline stage, grids, frames, packed)."""
        if imgs_sizes is None:
            if num_frames is not None:
                raise ValueError("num_frames goes with dynamic input; pass static clips as (B, T, C, H, W)")
            if pixel_values.dim() not in (4, 5):
                raise ValueError("static input must be (B, C, H, W) images or (B, T, C, H, W) clips, "
                                 f"got shape {tuple(pixel_values.shape)}")
            check_image_size(pixel_values.shape[-2], pixel_values.shape[-1], self.patch_dim)
            h, w = pixel_values.shape[-2] // self.patch_dim, pixel_values.shape[-1] // self.patch_dim
            batch, frames = (pixel_values.shape[:2] if pixel_values.dim() == 5
                             else (pixel_values.shape[0], 1))
            tokens = None
            if self.pre_process:
                tokens, _, _ = self.patch_embed.proj(pixel_values.reshape(-1, *pixel_values.shape[-3:]))
                tokens = tokens.reshape(batch, frames * h * w, -1)
            return tokens, [(h, w)], [frames], False
        grids, _ = _dynamic_patch_grid_lists(imgs_sizes, self.patch_dim)
        frames = [1] * len(grids) if num_frames is None else [int(t) for t in num_frames]
        if len(frames) != len(grids) or any(t < 1 for t in frames):
            raise ValueError(f"num_frames needs one count >= 1 per item: {len(grids)} items, got {frames}")
        if pixel_values.dim() != 3 or pixel_values.shape[0] != 1:
            raise ValueError("dynamic input must be pre-patchified rows of shape (1, ΣN, C*P*P)")
        total = sum(t * h * w for (h, w), t in zip(grids, frames))
        if pixel_values.shape[1] != total:
            raise ValueError(f"imgs_sizes and num_frames describe {total} patches but the input has "
                             f"{pixel_values.shape[1]} rows")
        tokens = self.patch_embed.proj(pixel_values) if self.pre_process else None
        return tokens, grids, frames, True

    def encode(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
               imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None,
               num_frames: Optional[Sequence[int]] = None) -> KimiVisionOutput:
        tokens, grids, frames, packed = self._patch_tokens(pixel_values, imgs_sizes, num_frames)
        # Refuse what the merger or the temporal table cannot take before running the transformer.
        for (h, w), t in zip(grids, frames):
            self.merger._check(h, w)
            check_clip_length(t, self.max_frames)
        device = pixel_values.device
        if tokens is not None:
            tokens = self.pos_embed(tokens, grids, frames)
        rope = self.rotary_pos_emb.packed(grids, frames, device)
        if packed and packed_seq_params is None:
            packed_seq_params = make_packed_seq_params(
                [t * h * w for (h, w), t in zip(grids, frames)], device)
        hidden = tokens.transpose(0, 1).contiguous() if self.pre_process else None
        hidden = self.decoder(hidden, attention_mask, rotary_pos_emb=rope,
                              packed_seq_params=packed_seq_params)
        if not self.post_process:
            return KimiVisionOutput(hidden, None, None, grids, frames)
        hidden = self.final_ln(hidden).transpose(0, 1).contiguous()
        if packed:
            pooled = self.merger.merge_packed(hidden, grids, frames)
        else:
            pooled = self.merger(hidden, grids[0][0], grids[0][1], frames[0])
        return KimiVisionOutput(hidden, pooled, None, grids, frames)

    def forward(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None,
                num_frames: Optional[Sequence[int]] = None) -> torch.Tensor:
        out = self.encode(pixel_values, attention_mask, imgs_sizes, packed_seq_params, num_frames)
        return out.pooler_output if out.pooler_output is not None else out.last_hidden_state


class SubTokenNormedColumnParallelLinear(NormedColumnParallelLinear):
    """``linear_fc1`` of Kimi's projector: the norm runs over each H-wide sub-token of the merged
    m²H input, each with its own block of the m²H ``layer_norm_weight`` / ``layer_norm_bias``.

    Those are Megatron's fused-norm parameters (``TELayerNormColumnParallelLinear``, which
    normalises the whole m²H vector); the converter fills them with Kimi's H-sized weight and bias
    tiled m² times, which makes this Kimi's per-sub-token LayerNorm, bit for bit (one norm call per
    sub-token, so each runs HF's arithmetic).
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 sub_tokens: int, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        if input_size % sub_tokens:
            raise ValueError(f"a merged width of {input_size} does not split into {sub_tokens} sub-tokens")
        self.sub_tokens = sub_tokens

    def norm(self, input_: torch.Tensor) -> torch.Tensor:
        parts = input_.unflatten(-1, (self.sub_tokens, -1))
        weights = self.layer_norm_weight.view(self.sub_tokens, -1)
        biases = self.layer_norm_bias.view(self.sub_tokens, -1)
        normed = [layer_norm(parts[..., j, :], weights[j], biases[j], self.norm_eps, self.norm_kind)
                  for j in range(self.sub_tokens)]
        return torch.stack(normed, dim=-2).flatten(-2)


class KimiMultimodalProjector(MegatronModule):
    """Kimi's projector: LayerNorm over H on each of the 4 sub-tokens, then an mcore MLP 4H->4H->text H.

    A LayerNorm over the whole 4H vector would be a different function. The MLP is mcore's own
    (``linear_fc1`` column-parallel with the per-sub-token norm fused in, ``linear_fc2``
    row-parallel), with erf GELU as HF's ``nn.GELU()``; ``config.hidden_size`` is the text hidden
    size, ``config.layernorm_epsilon`` the norm's.
    """

    def __init__(self, config: TransformerConfig, vision_hidden_size: int, merge_tokens: int = 4):
        super().__init__(config=config)
        self.vision_hidden_size, self.merge_tokens = vision_hidden_size, merge_tokens
        width = vision_hidden_size * merge_tokens
        fc1 = ModuleSpec(module=SubTokenNormedColumnParallelLinear, params={"sub_tokens": merge_tokens})
        self.encoder = MLP(config, MLPSubmodules(linear_fc1=fc1, linear_fc2=RowParallelLinear),
                           input_size=width, ffn_hidden_size=width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 4H) or (..., 4, H) merged tokens -> (..., text H)."""
        width = self.vision_hidden_size * self.merge_tokens
        lead = x.shape[:-2] if x.shape[-2:] == (self.merge_tokens, self.vision_hidden_size) else x.shape[:-1]
        if x.numel() != lead.numel() * width:
            raise ValueError(f"projector input must end in {self.merge_tokens}x{self.vision_hidden_size} "
                             f"or {width}, got {tuple(x.shape)}")
        flat = x.reshape(-1, 1, width)  # mcore linears take [s, b, h]
        out, bias = self.encoder(flat)
        if bias is not None:
            out = out + bias
        return out.reshape(*lead, out.shape[-1])


class KimiViTWithProjector(TowerWithProjection):
    """:class:`KimiViTModel` as ``vision_model``, then the projector as ``vision_projection``
    (``LLaVAModel``'s names): a whole-model config. ``forward`` returns the projected tokens
    ``(B, M, text H)``; under pipeline parallelism the projector lives on the last stage.
    """

    def __init__(self, vision_model: KimiViTModel, projection_config: TransformerConfig):
        merge = vision_model.merger.merge_size
        super().__init__(vision_model, lambda: KimiMultimodalProjector(
            projection_config, vision_model.hidden_size, merge * merge))

    def encode(self, *args, **kwargs) -> KimiVisionOutput:
        out = self.vision_model.encode(*args, **kwargs)
        if out.pooler_output is None:
            return out
        return out._replace(image_embeds=self.vision_projection(out.pooler_output))

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.encode(*args, **kwargs)
        return out.image_embeds if out.image_embeds is not None else out.last_hidden_state


def tower(model) -> KimiViTModel:
    """The vision tower of a native model (itself, or ``vision_model`` beside a projector)."""
    return model.vision_model if isinstance(model, KimiViTWithProjector) else model


# --- building from the HF config (the single source of truth for shapes) ---------------------

def _patch(vc) -> int:
    p = vc.patch_size
    return p if isinstance(p, int) else p[0]


def _merge(vc) -> int:
    kh, kw = tuple(vc.merge_kernel_size)
    if kh != kw:
        raise NotImplementedError(f"only square merge kernels are supported, got {kh}x{kw}")
    return kh



def transformer_config(vc, params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """The family's recipe (:func:`~mmparity.models.kimi_k25.config.transformer_fields`) with HF's
    own activation function."""
    fields = transformer_fields(vc)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **fields)


def projection_config(cfg, params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    vc = vision_cfg(cfg)
    _merge(vc)
    projection_hidden = getattr(cfg, "projection_hidden_size", None) or vc.hidden_size
    if projection_hidden != vc.hidden_size:
        raise ValueError(f"projection_hidden_size={projection_hidden} must equal the vision hidden size "
                         f"{vc.hidden_size}: the projector normalises each merged sub-token")
    fields = projection_fields(cfg)
    fields["activation"] = activation_from_hf(fields["activation"])
    # Attention fields are unused by the MLP; heads only need to satisfy TransformerConfig's checks.
    return vision_transformer_config(num_layers=1, num_attention_heads=vc.num_attention_heads, kv_channels=1,
                                     params_dtype=params_dtype, pipelined_stack=False, **fields)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> KimiViTModel:
    """``KimiViTModel`` from a ``Kimi_K25VisionConfig``; with the projector from a ``Kimi_K25Config``."""
    vc = vision_cfg(cfg)
    kwargs = dict(patch_dim=_patch(vc), img_h=vc.pos_emb_height * _patch(vc),
                  img_w=vc.pos_emb_width * _patch(vc), in_channels=3,
                  pos_embed_height=vc.pos_emb_height, pos_embed_width=vc.pos_emb_width,
                  rope_theta=rope_theta(vc), pos_embed_time=vc.pos_emb_time, merge_size=_merge(vc))
    model = KimiViTModel(transformer_config(vc, params_dtype), vision_layer_spec(), **kwargs)
    if has_projector(cfg):
        model = KimiViTWithProjector(model, projection_config(cfg, params_dtype))
    return model.to(params_dtype)
