"""LLaVA input preprocessing, written against Megatron-LM ``megatron/core/models/multimodal/llava_model.py``.

The functions at the top of this module are pure tensor code: they need neither an initialised
parallel state nor a model, so parity tests and data tooling can call them directly; they call
nothing from Megatron (only :func:`installed_mcore_pixel_shuffle_layout` does). The ``LLaVAModel``
section at the bottom of the module (which imports megatron-core) wires them to the vision
encoder and the language model; its own deviations are listed on :class:`LLaVAModel`.

Names follow that module; each private name has a
public alias without the leading underscore.

Deliberate deviations from Megatron-LM main and from the installed megatron-core (0.16.1):

- ``pixel_shuffle`` raises ``ValueError`` where upstream silently mis-shapes: a non-square token
  count without ``h``/``w`` (0.16.1 takes ``int(sqrt(n))`` and folds the remainder into the
  channels), odd grids, ``h*w`` not matching the sequence, a scale that is not ``1/r``.
  megatron-core 0.16-0.19's older ``h, w`` grouping (four consecutive raster tokens per output
  token) is only reachable with ``layout="mcore_legacy"``.
- ``_preprocess_data`` is a free function: the model attributes it reads upstream
  (``img_seq_len``, ``pre_process``, ``post_process``, the language model's maximum length,
  pipeline padding, context parallelism) are keyword arguments. Per-placeholder token counts are
  passed explicitly as ``media_token_counts`` instead of being derived from ``imgs_sizes`` inside
  the model (see :func:`temporal_tubelet_token_counts`). The inference-KV-cache short cut, the
  FSDP dummy-image trick and sound inputs stay with the model. It returns a named tuple that also
  carries the expanded input ids and position ids upstream lists among its returns.
- ``_preprocess_data`` checks that the number of image embedding rows equals the number of image
  slots and reports both numbers; upstream fails inside a masked assignment.
- ``_apply_tile_tagging`` takes the tag token lists and the embedding function as arguments and
  accepts several images (0.16.1 asserts a single image). The tag token ids depend on the
  tokenizer; neither Megatron-LM main nor the installed megatron-core pins them (see
  :func:`tile_tag_token_ids`).
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch

IGNORE_INDEX = -100
DEFAULT_IMAGE_TOKEN_INDEX = -200
IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"

PIXEL_SHUFFLE_LAYOUTS = ("spatial", "mcore_legacy")


# --------------------------------------------------------------------------------------------
# pixel shuffle
# --------------------------------------------------------------------------------------------


def _reduction_factor(scale_factor: float) -> int:
    """Side length r of the r x r neighbourhoods merged into one token (scale_factor = 1/r)."""
    if not 0 < scale_factor <= 1:
        raise ValueError(f"scale_factor must lie in (0, 1], got {scale_factor}")
    r = round(1 / scale_factor)
    if not math.isclose(r * scale_factor, 1.0, abs_tol=1e-9):
        raise ValueError(f"scale_factor must be 1/r for an integer r, got {scale_factor}")
    return r


def pixel_shuffle(x, scale_factor=0.5, version=2, h=None, w=None, *, layout="spatial"):
    """Merge each r x r neighbourhood of patches into one token (r = 1/scale_factor).

    Seed 001, ``llava_model.pixel_shuffle``: the InternVL convention. ``x`` is
    ``[num_tiles, h*w, C]`` in raster order; the result is ``[num_tiles, h*w/r², r²·C]``. Each
    output vector is patch-major, ``[top-left ‖ top-right ‖ bottom-left ‖ bottom-right]`` for
    r = 2. ``version=2`` lists the blocks row-major, ``version=1`` column-major (InternVL's
    original, transposed order). Equal to transformers' ``InternVLModel.pixel_shuffle`` on square
    and non-square grids.

    ``h``/``w`` give a non-square grid; without them the sequence must be a perfect square.

    ``layout="mcore_legacy"`` reproduces megatron-core 0.16-0.19 for an explicit ``h``/``w``
    (``pixel_shuffle`` in that release's ``llava_model.py``): each output token is r² consecutive raster tokens, so odd grids are accepted. This
    path is not checkable here (0.16.1 has no ``h``/``w`` parameter) and, because its block order
    for ``version=1`` is unknown, it only accepts ``version=2``. Without ``h``/``w`` both layouts
    are the spatial one, which is what 0.16.1 computes on square grids.
    """
    if layout not in PIXEL_SHUFFLE_LAYOUTS:
        raise ValueError(f"layout must be one of {PIXEL_SHUFFLE_LAYOUTS}, got {layout!r}")
    if version not in (1, 2):
        raise ValueError(f"version must be 1 or 2, got {version!r}")
    if x.dim() != 3:
        raise ValueError(
            f"expected x of shape [num_tiles, seq_len, channels], got {tuple(x.shape)}"
        )
    if (h is None) != (w is None):
        raise ValueError(f"pass both h and w or neither, got h={h}, w={w}")
    r = _reduction_factor(scale_factor)
    num_tiles, seq_len, channels = x.shape
    grid_given = h is not None
    if not grid_given:
        side = math.isqrt(seq_len)
        if side * side != seq_len:
            raise ValueError(
                f"sequence length {seq_len} is not a square number of patches; pass h and w"
            )
        h = w = side
    if h * w != seq_len:
        raise ValueError(f"grid {h}x{w} has {h * w} patches but the sequence has {seq_len}")

    if layout == "mcore_legacy" and grid_given:
        if version != 2:
            raise ValueError("layout='mcore_legacy' with an explicit grid only supports version=2")
        if seq_len % (r * r):
            raise ValueError(f"sequence length {seq_len} is not divisible by r²={r * r}")
        return x.reshape(num_tiles, seq_len // (r * r), r * r * channels)

    if h % r or w % r:
        raise ValueError(
            f"grid {h}x{w} must be divisible by {r} on both sides (scale {scale_factor})"
        )
    blocks = x.reshape(num_tiles, h // r, r, w // r, r, channels)
    # [tile, block_row, block_col, row_in_block, col_in_block, channel]: the two in-block axes
    # then the channel flatten into InternVL's patch-major vector.
    blocks = blocks.permute(0, 1, 3, 2, 4, 5)
    if version == 1:
        blocks = blocks.transpose(1, 2)
    return blocks.reshape(num_tiles, (h // r) * (w // r), r * r * channels)


def installed_mcore_pixel_shuffle_layout() -> str:
    """Which ``h, w`` behaviour the installed megatron-core ``pixel_shuffle`` implements.

    Runs it on a golden input (a 4x6 grid of ``arange(24)``, one channel) and compares.
    Returns ``"spatial"`` (Megatron-LM main's 2x2 neighbourhoods), ``"mcore_legacy"`` (four consecutive
    raster tokens), ``"square_only"`` (no ``h``/``w`` parameter, and its square-grid output equals
    the spatial layout: megatron-core 0.16.1) or ``"unknown"``.
    """
    from megatron.core.models.multimodal import llava_model as mcore_llava

    if not {"h", "w"} <= set(inspect.signature(mcore_llava.pixel_shuffle).parameters):
        square = torch.arange(16.0).reshape(1, 16, 1)
        same = torch.equal(mcore_llava.pixel_shuffle(square), pixel_shuffle(square))
        return "square_only" if same else "unknown"
    golden = torch.arange(24.0).reshape(1, 24, 1)
    try:
        got = mcore_llava.pixel_shuffle(golden, h=4, w=6)
    except Exception:  # an implementation that rejects 4x6 matches neither layout
        return "unknown"
    for layout in PIXEL_SHUFFLE_LAYOUTS:
        if torch.equal(got, pixel_shuffle(golden, h=4, w=6, layout=layout)):
            return layout
    return "unknown"


def _patch_grids(imgs_sizes, patch_dim: int) -> list[tuple[int, int]]:
    """Per-image (rows, cols) of patches; floor division, like the patch-embedding conv."""
    sizes = torch.as_tensor(imgs_sizes)
    if sizes.dim() != 2 or sizes.shape[1] != 2:
        raise ValueError(
            f"imgs_sizes must be [num_images, 2] (H, W) pixels, got {tuple(sizes.shape)}"
        )
    if patch_dim < 1:
        raise ValueError(f"patch_dim must be positive, got {patch_dim}")
    grids = [(int(hp) // patch_dim, int(wp) // patch_dim) for hp, wp in sizes.tolist()]
    for index, (rows, cols) in enumerate(grids):
        if rows < 1 or cols < 1:
            raise ValueError(
                f"image {index} of size {sizes[index].tolist()} is smaller than one patch"
            )
    return grids


def _shuffle_on_grids(chunks, grids, scale_factor, version):
    if len(chunks) != len(grids):
        raise ValueError(f"{len(chunks)} chunks but {len(grids)} image sizes")
    shuffled = []
    for index, (chunk, (rows, cols)) in enumerate(zip(chunks, grids)):
        if chunk.shape[-2] != rows * cols:
            raise ValueError(
                f"chunk {index} has {chunk.shape[-2]} tokens but its {rows}x{cols} patch grid "
                f"has {rows * cols}"
            )
        shuffled.append(pixel_shuffle(chunk, scale_factor, version, h=rows, w=cols))
    return shuffled


def _pixel_shuffle_dynamic_resolution_chunks(
    chunks, image_sizes, patch_dim, scale_factor=0.5, version=2
):
    """Pixel-shuffle each image's chunk ``[n, rows*cols, C]`` on its own patch grid (upstream's function of the same name).

    ``image_sizes`` are pixel sizes ``[num_images, 2]``; the grid is ``size // patch_dim``.
    Returns the list of shuffled chunks.
    """
    grids = _patch_grids(image_sizes, patch_dim)
    return _shuffle_on_grids(list(chunks), grids, scale_factor, version)


def pixel_shuffle_dynamic_res(x, imgs_sizes, patch_dim, scale_factor=0.5, version=2):
    """Pixel shuffle for a packed sequence of differently sized images (upstream's function of the same name).

    ``x`` is ``[batch, Σ rows_i·cols_i, C]``; each image's tokens are shuffled on its own grid
    and the results concatenated in order: ``[batch, Σ rows_i·cols_i/r², r²·C]``.
    """
    grids = _patch_grids(imgs_sizes, patch_dim)
    lengths = [rows * cols for rows, cols in grids]
    if sum(lengths) != x.shape[-2]:
        raise ValueError(
            f"image sizes give {sum(lengths)} patches ({lengths}) but x has {x.shape[-2]} tokens"
        )
    chunks = torch.split(x, lengths, dim=-2)
    return torch.cat(_shuffle_on_grids(chunks, grids, scale_factor, version), dim=-2)


pixel_shuffle_dynamic_resolution_chunks = _pixel_shuffle_dynamic_resolution_chunks


# --------------------------------------------------------------------------------------------
# placeholder expansion
# --------------------------------------------------------------------------------------------


class PreprocessedInputs(NamedTuple):
    """What :func:`_preprocess_data` returns; fields are None where the stage does not need them."""

    embeddings: Optional[torch.Tensor]  # [s, b, h] if sequence_first else [b, s, h]
    labels: Optional[torch.Tensor]  # [b, s]
    loss_mask: Optional[torch.Tensor]  # [b, s]
    input_ids: Optional[torch.Tensor]  # [b, s], image slots hold the placeholder id
    position_ids: Optional[torch.Tensor]  # [b, s]


def _slots_per_placeholder(
    num_placeholders, image_embeddings, num_image_tiles, img_seq_len, media_token_counts, device
):
    if media_token_counts is not None:
        counts = torch.as_tensor(media_token_counts, dtype=torch.long, device=device).reshape(-1)
        if counts.numel() != num_placeholders:
            raise ValueError(
                f"{counts.numel()} media_token_counts for {num_placeholders} image placeholders"
            )
    else:
        if num_image_tiles is None:
            tiles = torch.ones(num_placeholders, dtype=torch.long, device=device)
        else:
            tiles = torch.as_tensor(num_image_tiles, dtype=torch.long, device=device).reshape(-1)
        if tiles.numel() != num_placeholders:
            raise ValueError(
                f"{tiles.numel()} num_image_tiles for {num_placeholders} image placeholders"
            )
        if num_placeholders == 0:
            return tiles
        if img_seq_len is None:
            if image_embeddings is None or image_embeddings.dim() != 3:
                raise ValueError(
                    "cannot tell the tokens per tile: pass img_seq_len, media_token_counts or "
                    "image_embeddings of shape [img_seq_len, num_tiles, hidden]"
                )
            img_seq_len = image_embeddings.shape[0]
        if (tiles < 1).any():
            raise ValueError(f"every image needs at least one tile, got {tiles.tolist()}")
        counts = tiles * int(img_seq_len)
    if (counts < 1).any():
        raise ValueError(
            f"every placeholder must expand to at least one slot, got {counts.tolist()}"
        )
    return counts


def _image_rows(image_embeddings, hidden):
    """Image embeddings in slot order: [img_seq_len, num_tiles, h] is read tile by tile."""
    if image_embeddings is None or image_embeddings.numel() == 0:
        return None
    if image_embeddings.dim() == 3:
        image_embeddings = image_embeddings.permute(1, 0, 2)
    elif image_embeddings.dim() != 2:
        raise ValueError(
            "image_embeddings must be [img_seq_len, num_tiles, hidden] or [num_slots, hidden], "
            f"got {tuple(image_embeddings.shape)}"
        )
    if image_embeddings.shape[-1] != hidden:
        raise ValueError(
            f"image hidden size {image_embeddings.shape[-1]} differs from the text's {hidden}"
        )
    return image_embeddings.reshape(-1, hidden)


def _preprocess_data(
    image_embeddings,
    language_embeddings,
    input_ids,
    loss_mask,
    labels,
    image_token_index=DEFAULT_IMAGE_TOKEN_INDEX,
    num_image_tiles=None,
    *,
    img_seq_len=None,
    media_token_counts=None,
    position_ids=None,
    language_max_sequence_length=None,
    pad_to_language_max_sequence_length=False,
    pre_process=True,
    post_process=True,
    sequence_first=True,
    pad_token_id=0,
) -> PreprocessedInputs:
    """Expand each image placeholder into its embedding slots (``_preprocess_data`` of Megatron-LM ``megatron/core/models/multimodal/llava_model.py``).

    Inputs follow mcore's conventions: ``input_ids`` ``[b, t]`` with one ``image_token_index`` per
    image; ``language_embeddings`` ``[b, t, h]`` (batch first); ``labels`` pre-shifted
    (``labels[i]`` is the target at position i); ``loss_mask`` ``[b, t]``; ``image_embeddings``
    ``[img_seq_len, num_tiles, h]`` (read tile by tile) or ``[num_slots, h]``.

    Placeholder k becomes ``media_token_counts[k]`` slots, or ``num_image_tiles[k] * img_seq_len``
    (one tile per image and ``img_seq_len = image_embeddings.shape[0]`` by default). Rows of
    different lengths are right-padded to the longest (embedding 0, label ``IGNORE_INDEX``, loss
    mask 0, id ``pad_token_id``, position 0), optionally padded up to
    ``language_max_sequence_length`` (pipeline parallelism needs a fixed length), then truncated to
    it.

    Labels and loss mask, per input token t whose last slot is p:
    - text token: ``labels[t]`` and ``loss_mask[t]`` at p;
    - image placeholder: ``IGNORE_INDEX`` and 0 on every slot except that the last slot p carries
      ``labels[t]`` (the next text token) with loss mask 0;
    - a token followed by an image placeholder gets ``IGNORE_INDEX`` and loss mask 0, so text never
      learns to predict an image.
    Position ids count one per slot: the slot ``p`` owned by token ``t`` gets
    ``position_ids[t] + p - t`` (``arange`` when ``position_ids`` is None).

    See the module docstring for deviations from upstream.
    """
    if not pre_process and not post_process:
        return PreprocessedInputs(None, None, None, None, None)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be a non-empty [batch, seq_len], got {tuple(input_ids.shape)}"
        )
    batch, text_len = input_ids.shape
    device = input_ids.device

    is_placeholder = input_ids == image_token_index
    num_placeholders = int(is_placeholder.sum())
    counts = _slots_per_placeholder(
        num_placeholders, image_embeddings, num_image_tiles, img_seq_len, media_token_counts, device
    )

    span = torch.ones_like(input_ids, dtype=torch.long)
    span[is_placeholder] = counts  # boolean indexing is row-major: placeholders in reading order
    last_slot = span.cumsum(dim=1) - 1
    seq_lens = last_slot[:, -1] + 1
    combined_len = int(seq_lens.max())
    if pad_to_language_max_sequence_length and language_max_sequence_length is not None:
        combined_len = max(combined_len, language_max_sequence_length)

    slot = torch.arange(combined_len, device=device).expand(batch, combined_len)
    # The token owning slot p is the first one whose last slot is >= p; slots past the row's end
    # get the last token as a harmless stand-in and are masked by in_row.
    owner = torch.searchsorted(last_slot, slot.contiguous()).clamp_(max=text_len - 1)
    in_row = slot < seq_lens[:, None]
    owner_is_image = is_placeholder.gather(1, owner) & in_row
    owner_is_text = ~is_placeholder.gather(1, owner) & in_row

    final_input_ids = torch.where(in_row, input_ids.gather(1, owner), pad_token_id)
    if position_ids is None:
        position_ids = torch.arange(text_len, device=device).expand(batch, text_len)
    elif position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} differs from input_ids "
            f"{tuple(input_ids.shape)}"
        )
    final_position_ids = torch.where(in_row, position_ids.gather(1, owner) + (slot - owner), 0)

    final_embeddings = None
    if pre_process:
        if language_embeddings is None or language_embeddings.shape[:2] != input_ids.shape:
            shape = None if language_embeddings is None else tuple(language_embeddings.shape)
            raise ValueError(
                f"language_embeddings must be [batch, seq_len, hidden] like input_ids, got {shape}"
            )
        hidden = language_embeddings.shape[-1]
        final_embeddings = language_embeddings.new_zeros(batch, combined_len, hidden)
        owner_rows = owner.unsqueeze(-1).expand(batch, combined_len, hidden)
        final_embeddings[owner_is_text] = language_embeddings.gather(1, owner_rows)[owner_is_text]
        image_rows = _image_rows(image_embeddings, hidden)
        num_image_rows = 0 if image_rows is None else image_rows.shape[0]
        num_image_slots = int(owner_is_image.sum())
        if num_image_rows != num_image_slots:
            raise ValueError(
                f"{num_image_rows} image embedding rows for {num_image_slots} image slots "
                f"(slots per placeholder: {counts.tolist()})"
            )
        if image_rows is not None:
            if image_rows.dtype != final_embeddings.dtype:
                raise ValueError(
                    f"image embeddings are {image_rows.dtype}, "
                    f"text embeddings {final_embeddings.dtype}"
                )
            final_embeddings[owner_is_image] = image_rows

    final_labels = final_loss_mask = None
    if post_process and labels is not None:
        if loss_mask is None or labels.shape != input_ids.shape or loss_mask.shape != labels.shape:
            raise ValueError(
                "labels and loss_mask must both be [batch, seq_len] like input_ids, got "
                f"{tuple(labels.shape)} and {None if loss_mask is None else tuple(loss_mask.shape)}"
            )
        next_is_placeholder = torch.zeros_like(is_placeholder)
        next_is_placeholder[:, :-1] = is_placeholder[:, 1:]
        keeps_target = (~next_is_placeholder).gather(1, owner)
        on_last_slot = slot == last_slot.gather(1, owner)
        final_labels = torch.where(
            in_row & on_last_slot & keeps_target, labels.gather(1, owner), IGNORE_INDEX
        )
        final_loss_mask = torch.where(
            owner_is_text & keeps_target,
            loss_mask.gather(1, owner),
            torch.zeros((), dtype=loss_mask.dtype, device=device),
        )

    if language_max_sequence_length is not None and combined_len > language_max_sequence_length:
        keep = slice(0, language_max_sequence_length)
        final_input_ids, final_position_ids = final_input_ids[:, keep], final_position_ids[:, keep]
        if final_embeddings is not None:
            final_embeddings = final_embeddings[:, keep]
        if final_labels is not None:
            final_labels, final_loss_mask = final_labels[:, keep], final_loss_mask[:, keep]

    if final_embeddings is not None and sequence_first:
        final_embeddings = final_embeddings.transpose(0, 1).contiguous()
    return PreprocessedInputs(
        final_embeddings, final_labels, final_loss_mask, final_input_ids, final_position_ids
    )


preprocess_data = _preprocess_data


# --------------------------------------------------------------------------------------------
# tile tags (NVLM, arXiv:2409.11402)
# --------------------------------------------------------------------------------------------

# Tokens per tile tag, as megatron-core's get_num_image_embeddings (vision/clip_vit_model.py)
# reserves them. The ids themselves come from tokenizing tile_tag_texts with the model's tokenizer.
TILE_TAG_TOKENS_PER_FORMAT = {
    "llama3p1": 5,
    "chatml": 5,
    "qwen2p0": 5,
    "qwen2p5": 5,
    "nemotron5": 6,
}


def tile_tag_token_count(prompt_format: str, max_num_tiles: int = 0) -> int:
    """Tokens per tile tag for a prompt format, with megatron-core's rules.

    ``nemotron5*`` formats use 6; llama3p1 / chatml / qwen2p0 / qwen2p5 use 5, plus one padding
    token for qwen formats when 10 < ``max_num_tiles`` < 100 (two-digit tile numbers).
    """
    if max_num_tiles > 100:
        raise ValueError(f"max_num_tiles {max_num_tiles} > 100 is not supported")
    if prompt_format.startswith("nemotron5"):
        count = TILE_TAG_TOKENS_PER_FORMAT["nemotron5"]
    elif prompt_format in TILE_TAG_TOKENS_PER_FORMAT:
        count = TILE_TAG_TOKENS_PER_FORMAT[prompt_format]
    else:
        raise ValueError(
            f"unknown prompt format {prompt_format!r}; known: {sorted(TILE_TAG_TOKENS_PER_FORMAT)}"
        )
    if prompt_format.startswith("qwen") and 10 < max_num_tiles < 100:
        count += 1
    return count


def tile_tag_texts(max_num_tiles: int, thumbnail_tag: str = "<tile_global_thumbnail>") -> list[str]:
    """NVLM's tag strings: ``<tile_1>`` ... ``<tile_N>`` then the thumbnail tag."""
    if max_num_tiles < 1:
        raise ValueError(f"max_num_tiles must be positive, got {max_num_tiles}")
    return [f"<tile_{i}>" for i in range(1, max_num_tiles + 1)] + [thumbnail_tag]


def tile_tag_token_ids(
    tokenize: Callable[[str], Sequence[int]],
    prompt_format: str,
    max_num_tiles: int,
    *,
    thumbnail_tag: str = "<tile_global_thumbnail>",
    skip_leading: int = 0,
) -> list[list[int]]:
    """Token id lists of the tile tags for ``_apply_tile_tagging``, checked against the format.

    ``tokenize`` maps text to ids (``skip_leading`` drops a BOS the tokenizer prepends). Every tag
    must come out at :func:`tile_tag_token_count` tokens: the model reserves exactly that many
    slots per tile, so a different tokenizer would silently shift every image slot.
    """
    expected = tile_tag_token_count(prompt_format, max_num_tiles)
    texts = tile_tag_texts(max_num_tiles, thumbnail_tag)
    tags = [list(tokenize(text))[skip_leading:] for text in texts]
    wrong = {text: len(ids) for text, ids in zip(texts, tags) if len(ids) != expected}
    if wrong:
        raise ValueError(f"{prompt_format} tile tags must be {expected} tokens each, got {wrong}")
    return tags


def _apply_tile_tagging(image_embeddings, num_image_tiles, tile_tags, embed_tokens):
    """Prepend each tile's tag embeddings to its image embeddings (upstream's function of the same name).

    ``image_embeddings`` ``[img_seq_len, num_tiles, h]``; ``num_image_tiles`` tiles per image
    (several images allowed, tiles in order); ``tile_tags`` the per-tile token id lists
    ``[tile_1, ..., tile_N, thumbnail]``; ``embed_tokens`` maps ids ``[tiles, tag_len]`` to
    ``[tiles, tag_len, h]`` (an ``nn.Embedding``; wrap mcore's sequence-first embedding). An image
    with n tiles uses ``tile_tags[:n-1]`` and then the thumbnail tag for its last tile. Returns
    ``[tag_len + img_seq_len, num_tiles, h]``.
    """
    tiles_per_image = [int(n) for n in torch.as_tensor(num_image_tiles).reshape(-1).tolist()]
    if image_embeddings.dim() != 3:
        raise ValueError(
            "image_embeddings must be [img_seq_len, num_tiles, hidden], got "
            f"{tuple(image_embeddings.shape)}"
        )
    if sum(tiles_per_image) != image_embeddings.shape[1]:
        raise ValueError(
            f"num_image_tiles {tiles_per_image} sum to {sum(tiles_per_image)} but there are "
            f"{image_embeddings.shape[1]} tiles"
        )
    if not tile_tags or len({len(tag) for tag in tile_tags}) != 1:
        raise ValueError(f"tile tags must be non-empty and of equal length, got {tile_tags}")
    for n in tiles_per_image:
        if not 1 <= n <= len(tile_tags):
            raise ValueError(
                f"an image has {n} tiles; {len(tile_tags)} tags cover 1 to {len(tile_tags)} tiles"
            )
    tag_ids = [tag for n in tiles_per_image for tag in list(tile_tags[: n - 1]) + [tile_tags[-1]]]
    tag_ids = torch.tensor(tag_ids, dtype=torch.long, device=image_embeddings.device)
    tag_embeddings = embed_tokens(tag_ids)
    expected = (tag_ids.shape[0], tag_ids.shape[1], image_embeddings.shape[2])
    if tuple(tag_embeddings.shape) != expected:
        raise ValueError(
            f"embed_tokens returned {tuple(tag_embeddings.shape)}, expected {expected}"
        )
    return torch.cat([tag_embeddings.transpose(0, 1).to(image_embeddings.dtype), image_embeddings])


apply_tile_tagging = _apply_tile_tagging


# --------------------------------------------------------------------------------------------
# packed-sample loss weights
# --------------------------------------------------------------------------------------------


def _precalculate_loss_weights(boundaries, labels):
    """Per-token loss weights for packed samples, before context-parallel sharding (upstream's function of the same name).

    ``boundaries`` are cumulative sample starts (``cu_seqlens``), clamped to the sequence length;
    ``labels`` is ``[T]`` or ``[1, T]``. Each non-ignored token of a sample with n such tokens gets
    ``1/sqrt(n)``; the weights are then normalised to sum to 1, so long samples count more than
    short ones but less than proportionally. Returns float32 weights shaped like ``labels``.
    Raises ``ValueError`` when every label is ignored or a non-ignored token lies outside all
    samples.
    """
    labels = torch.as_tensor(labels)
    if not (labels.dim() == 1 or (labels.dim() == 2 and labels.shape[0] == 1)):
        raise ValueError(
            f"labels must be [T] or [1, T] (one packed row), got {tuple(labels.shape)}"
        )
    flat_labels = labels.reshape(-1)
    total = flat_labels.numel()
    starts = torch.as_tensor(boundaries, dtype=torch.long, device=flat_labels.device).reshape(-1)
    if starts.numel() < 2:
        raise ValueError(f"boundaries need at least two entries, got {starts.tolist()}")
    if starts[0] < 0 or (starts[1:] < starts[:-1]).any():
        raise ValueError(
            f"boundaries must be non-negative and non-decreasing, got {starts.tolist()}"
        )
    starts = starts.clamp(max=total)

    position = torch.arange(total, device=flat_labels.device)
    # right=True puts a position into the last of several equal boundaries, i.e. past empty samples.
    sample = (torch.searchsorted(starts, position, right=True) - 1).clamp_(0, starts.numel() - 2)
    covered = (position >= starts[0]) & (position < starts[-1])
    valid = flat_labels != IGNORE_INDEX
    if (valid & ~covered).any():
        raise ValueError(
            f"labels at positions {position[valid & ~covered].tolist()} lie outside the samples "
            f"{starts.tolist()}"
        )
    if not valid.any():
        raise ValueError("every label is IGNORE_INDEX: there is no token to weight")
    valid_sample = sample[valid]
    valid_per_sample = torch.zeros(starts.numel() - 1, device=flat_labels.device)
    valid_per_sample.index_add_(0, valid_sample, torch.ones_like(valid_sample, dtype=torch.float32))
    weights = torch.where(valid, valid_per_sample[sample].clamp(min=1).rsqrt(), 0.0)
    return (weights / weights.sum()).reshape(labels.shape)


precalculate_loss_weights = _precalculate_loss_weights


# --------------------------------------------------------------------------------------------
# temporal (video) token counts
# --------------------------------------------------------------------------------------------


def temporal_tubelet_token_counts(
    imgs_sizes, num_frames, patch_dim, temporal_patch_dim=1, spatial_merge=1
):
    """Token count of every tubelet and the number of tubelets of every media item.

    ``imgs_sizes`` has one (H, W) pixel row per frame, media items one after another;
    ``num_frames`` gives each item's frame count (an int applies to every item; None means every
    row is a still image). A video of nf frames gives ``ceil(nf / temporal_patch_dim)`` tubelets
    (the encoder pads the last one); a tubelet has ``(rows/m)·(cols/m)`` tokens for its patch grid
    with ``m = spatial_merge`` (2 for a 2x2 conv merger or pixel shuffle). Frames sharing a tubelet
    must have the same size. Returns ``(tubelet_token_counts [num_tubelets],
    media_tubelet_counts)``, the inputs of :func:`_group_temporal_token_counts_tensor`.
    """
    if imgs_sizes is None:
        raise ValueError("temporal token counts need imgs_sizes (one (H, W) row per frame)")
    if temporal_patch_dim < 1 or spatial_merge < 1:
        raise ValueError(
            "temporal_patch_dim and spatial_merge must be positive, got "
            f"{temporal_patch_dim}, {spatial_merge}"
        )
    grids = _patch_grids(imgs_sizes, patch_dim)
    if num_frames is None:
        frames = [1] * len(grids)
    elif isinstance(num_frames, int):
        if num_frames < 1:
            raise ValueError(f"frame counts must be positive, got {num_frames}")
        if len(grids) % num_frames:
            raise ValueError(
                f"{len(grids)} frame sizes do not split into items of {num_frames} frames"
            )
        frames = [num_frames] * (len(grids) // num_frames)
    else:
        frames = [int(n) for n in torch.as_tensor(num_frames).reshape(-1).tolist()]
    if any(n < 1 for n in frames):
        raise ValueError(f"frame counts must be positive, got {frames}")
    if sum(frames) != len(grids):
        raise ValueError(
            f"frame counts {frames} sum to {sum(frames)} but there are {len(grids)} frame sizes"
        )

    tubelet_tokens, tubelets_per_item = [], []
    first_frame = 0
    for item_frames in frames:
        item_grids = grids[first_frame : first_frame + item_frames]
        first_frame += item_frames
        tubelets = [
            item_grids[k : k + temporal_patch_dim]
            for k in range(0, item_frames, temporal_patch_dim)
        ]
        for tubelet in tubelets:
            if len(set(tubelet)) != 1:
                raise ValueError(f"frames of one tubelet have different patch grids: {tubelet}")
            rows, cols = tubelet[0]
            if rows % spatial_merge or cols % spatial_merge:
                raise ValueError(
                    f"patch grid {rows}x{cols} is not divisible by the merge size {spatial_merge}"
                )
            tubelet_tokens.append((rows // spatial_merge) * (cols // spatial_merge))
        tubelets_per_item.append(len(tubelets))
    return torch.tensor(tubelet_tokens, dtype=torch.long), tubelets_per_item


def _group_temporal_token_counts_tensor(tubelet_token_counts, media_tubelet_counts):
    """Sum consecutive tubelet token counts into one count per media item (upstream's function of the same name).

    Stays on the counts' device: the grouping index is built from the host-side list, so no
    device-to-host copy of the counts is needed.
    """
    counts = torch.as_tensor(tubelet_token_counts).reshape(-1)
    groups = [int(n) for n in media_tubelet_counts]
    if any(n < 1 for n in groups):
        raise ValueError(f"tubelet counts per media item must be positive, got {groups}")
    if sum(groups) != counts.numel():
        raise ValueError(
            f"media_tubelet_counts {groups} sum to {sum(groups)} but there are "
            f"{counts.numel()} tubelets"
        )
    item_of_tubelet = torch.repeat_interleave(
        torch.arange(len(groups), device=counts.device),
        torch.tensor(groups, device=counts.device),
    )
    return torch.zeros(len(groups), dtype=counts.dtype, device=counts.device).index_add_(
        0, item_of_tubelet, counts
    )


def _align_temporal_token_counts_to_placeholders(
    tubelet_token_counts, media_tubelet_counts, input_ids, image_token_index
):
    """One token count per placeholder in ``input_ids`` (upstream's function of the same name).

    Compact inference prompts hold one placeholder per media item, so counts are summed per item;
    expanded training prompts hold one placeholder per tubelet, so counts are returned as they
    are. Any other number of placeholders is an error. (The seed names the two cases but not
    their layout; this reading is ours.)
    """
    per_item = _group_temporal_token_counts_tensor(tubelet_token_counts, media_tubelet_counts)
    per_tubelet = torch.as_tensor(tubelet_token_counts).reshape(-1)
    num_placeholders = int((input_ids == image_token_index).sum())
    if num_placeholders == per_item.numel():
        return per_item
    if num_placeholders == per_tubelet.numel():
        return per_tubelet
    raise ValueError(
        f"{num_placeholders} placeholders match neither the {per_item.numel()} media items nor "
        f"the {per_tubelet.numel()} tubelets"
    )


group_temporal_token_counts_tensor = _group_temporal_token_counts_tensor
align_temporal_token_counts_to_placeholders = _align_temporal_token_counts_to_placeholders
