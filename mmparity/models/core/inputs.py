"""Seeded, non-constant paired inputs: several images, non-square, off the config's default size."""

from __future__ import annotations

from typing import Sequence

import torch

ImageSize = tuple[int, int]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(sizes: Sequence[ImageSize], channels: int, seed: int) -> list[torch.Tensor]:
    """One (C, H, W) float32 image per size; normal noise plus a per-image ramp so no two agree."""
    gen = generator(seed)
    out = []
    for index, (height, width) in enumerate(sizes):
        noise = torch.randn(channels, height, width, generator=gen)
        ramp = torch.linspace(-1.0, 1.0, height * width).view(1, height, width) * (index + 1) / len(sizes)
        out.append(noise + ramp)
    return out


def pad_batch(imgs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[ImageSize]]:
    """Zero-pad to the largest height and width -> (B, C, Hmax, Wmax) and the true sizes."""
    channels = imgs[0].shape[0]
    h_max = max(i.shape[1] for i in imgs)
    w_max = max(i.shape[2] for i in imgs)
    batch = torch.zeros(len(imgs), channels, h_max, w_max, dtype=imgs[0].dtype, device=imgs[0].device)
    for b, img in enumerate(imgs):
        batch[b, :, : img.shape[1], : img.shape[2]] = img
    return batch, [(i.shape[1], i.shape[2]) for i in imgs]


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """(C, H, W) -> (h·w, C·P·P) rows in raster order, each row flattened in (C, P, P) order."""
    channels, height, width = image.shape
    grid = image.view(channels, height // patch, patch, width // patch, patch)
    return grid.permute(1, 3, 0, 2, 4).reshape(-1, channels * patch * patch)


def packed_rows(imgs: Sequence[torch.Tensor], patch: int) -> torch.Tensor:
    """Several images as one pre-patchified packed sequence (1, ΣN, C·P·P)."""
    return torch.cat([patchify(i, patch) for i in imgs], dim=0).unsqueeze(0)


def native_images(model, case, packed: bool) -> tuple[torch.Tensor, dict]:
    """A case's images as a ViT-style native model takes them, on its device and dtype: one stacked
    batch, or (``packed``) pre-patchified rows of every image with ``imgs_sizes``."""
    param = next(model.parameters())
    imgs = case.data["images"]
    if packed:
        return packed_rows(imgs, model.patch_dim).to(param.device, param.dtype), {"imgs_sizes": case.data["sizes"]}
    return torch.stack(imgs).to(param.device, param.dtype), {}


def random_like_state(state: dict, seed: int) -> dict:
    """Seeded random values for every floating tensor of a state dict, at trained-network scale.

    Matrices get std 1/sqrt(fan_in) (so activations neither vanish nor saturate the softmax, which
    would make fp32 parity depend on the conditioning of a random network rather than on the
    implementation), vectors std 0.1, norm weights and layer scalars 1 ± 0.2 — non-constant everywhere, so a swapped
    or misplaced tensor always shows; a clamp's scalar bounds (``…_min`` / ``…_max``) ±(1 to 2).
    """
    gen = generator(seed)
    out = {}
    for key, value in state.items():
        if not torch.is_floating_point(value):
            out[key] = value
            continue
        noise = torch.randn(value.shape, generator=gen, dtype=torch.float32)
        if value.dim() >= 2:
            fan_in = max(1, value[0].numel())
            noise = noise / fan_in ** 0.5
        elif ("norm" in key and key.endswith("weight")) or key.endswith("layer_scalar"):
            # A layer's output scale (Gemma 4's layer_scalar) as a norm's: around 1; at std 0.1 it
            # would shrink the residual stream tenfold per layer.
            noise = 1.0 + 0.2 * noise
        elif value.dim() == 0 and key.endswith(("_min", "_max")):
            # A clamp's bound (Gemma 4's clipped linears): below or above zero at activation scale,
            # so the clamp cuts some values and keeps most (a lower bound above the upper one would
            # make every output the same).
            noise = (1.0 + 0.5 * noise.abs()) * (-1.0 if key.endswith("_min") else 1.0)
        else:
            noise = 0.1 * noise
        out[key] = noise.to(value.dtype)
    return out


def within(sizes: Sequence[ImageSize], side: int, step: int, least: int = 1) -> list[ImageSize]:
    """Default inputs inside what a config allows: ``sizes`` (multiples of ``step``) as they are
    when no side is over ``side`` pixels, else all scaled by one factor so that the longest fits,
    each side a multiple of ``step`` and at least ``least`` of them, so the images keep their
    distinct shapes."""
    most = max(least, side // step)
    longest = max(max(h, w) for h, w in sizes) // step
    if longest <= most:
        return list(sizes)
    return [tuple(step * min(most, max(least, int(n // step * most / longest + 0.5))) for n in size)
            for size in sizes]


# Component checks use a grid that is neither square nor the config's default.
COMPONENT_GRID = (5, 7)


def component_image_size(patch: int) -> tuple[int, int]:
    return (COMPONENT_GRID[0] * patch, COMPONENT_GRID[1] * patch)


def rope_probe(num_heads: int, head_dim: int, grid: tuple[int, int], seed: int) -> torch.Tensor:
    """Seeded query-like activations (N, heads, head_dim) for rotary-embedding checks."""
    gen = generator(seed + 7919)
    return torch.randn(grid[0] * grid[1], num_heads, head_dim, generator=gen)


def block_first_patch_rows(frames: torch.Tensor, patch: int, merge: int) -> torch.Tensor:
    """(T, C, H, W) frames -> (h·w, C·T·P·P) rows in the Qwen-VL image processor's layout.

    Patches come block-first (the m×m patches of each merge block are consecutive, blocks in
    raster order) and each row is flattened (C, T, P, P). A still image in the processor's layout
    is its frame repeated T times; T = 1 gives single-frame rows of width C·P·P.
    """
    frames_n, channels, height, width = frames.shape
    if height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"image size {height}x{width} is not a multiple of patch*merge = "
                         f"{patch}*{merge}")
    bh, bw = height // (patch * merge), width // (patch * merge)
    grid = frames.reshape(frames_n, channels, bh, merge, patch, bw, merge, patch)
    # axes: T C bh mh py bw mw px -> bh bw mh mw C T py px
    rows = grid.permute(2, 5, 3, 6, 1, 0, 4, 7)
    return rows.reshape(bh * bw * merge * merge, channels * frames_n * patch * patch)


def grids_around_table(table_side: int, merge: int) -> list[tuple[int, int]]:
    """Two non-square patch grids (multiples of ``merge``) for checks of a learned g×g table:
    one smaller than the table, one larger than it on both axes."""
    beyond = (table_side // merge + 1) * merge
    return [(merge, 2 * merge), (beyond, beyond + merge)]


def token_probe(num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """Seeded hidden-state-like activations (num_tokens, hidden) for checks of a single module."""
    gen = generator(seed + 104729)
    return torch.randn(num_tokens, hidden, generator=gen)


def component_grids_thw(table_hw: tuple[int, int], max_frames: int) -> list[tuple[int, int, int]]:
    """(frames, h, w) grids for learned-position-table checks: a resampled still grid, a short
    clip (up to 3 frames, bounded by the temporal table) and the table's own grid (identity path)."""
    return [(1, *COMPONENT_GRID), (max(1, min(3, max_frames)), 4, 6), (1, *table_hw)]


# (frames, h, w) grids that a 2x2 merger tiles, clips included, for merger-only checks.
MERGER_GRIDS_THW = ((1, 4, 6), (3, 2, 4), (2, 6, 2))


def like_model(t: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Move a CPU-generated probe to the device and dtype of ``model``'s parameters."""
    param = next(model.parameters())
    return t.to(device=param.device, dtype=param.dtype)


# LLaVA expansion check: compact rows ("I" is an image placeholder), tiles per placeholder in
# reading order, embedding slots per tile. Both sides build from this one layout and recipe.
EXPANSION_ROWS = ("tttIttttt", "ttIttIttt")
EXPANSION_TILES = (1, 2, 1)
EXPANSION_SLOTS_PER_TILE = 3


def compact_llava_batch(vocab_size: int, seed: int, placeholder: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded compact ids with ``placeholder`` at the image positions of ``EXPANSION_ROWS`` and
    pre-shifted labels (the next id; a random id after the last token)."""
    length = len(EXPANSION_ROWS[0])
    gen = generator(seed + 7727)
    ids = torch.randint(0, vocab_size, (len(EXPANSION_ROWS), length), generator=gen)
    for b, row in enumerate(EXPANSION_ROWS):
        for t, kind in enumerate(row):
            if kind == "I":
                ids[b, t] = placeholder
    after = torch.randint(0, vocab_size, (len(EXPANSION_ROWS), 1), generator=gen)
    return ids, torch.cat([ids[:, 1:], after], dim=1)


def token_mask(ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """Positions whose next token is text: the ones a language-model loss trains (a whole VLM's
    per-token loss is compared there)."""
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, :-1] = ids[:, 1:] != image_token_id
    return mask


def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """Each position's label: the token after it (the last position's is 0, masked out)."""
    return torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
