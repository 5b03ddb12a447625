"""LLaVA parity: one two-row batch in both conventions (mcore's compact ids with placeholders,
HF's expanded ids), each side's paired modules (the tower's own pairs under ``vision.``) and the
preprocessing components, and the family's hook record.

Compared outputs: ``logits`` at every position over the real vocabulary; ``loss_mask``, mcore's
expanded mask, on the HF side derived from its convention (a position trains iff it is text and
the next token is text; mcore also masks the last image slot, which HF trains, and the final
token, which has no next token inside the row); ``token_loss``, HF's shifted per-token cross
entropy at the positions the mask keeps.

The tower is any registered family with a :class:`~mmparity.models.spec.LlavaTower` adapter,
found through the registry's ``towers`` lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlavaConfig

from mmparity.models.core import inputs, processor
from mmparity.models.spec import (
    Bench, Case, ConfigHooks, FamilyHooks, MegatronClasses, Pair, Parity, Published, Side, TowerLookup, tokens_2d)
from mmparity.models.llava import mapping as converter
from mmparity.config import (
    first_int, has_patch_merger, image_hw, image_token_id, pixel_shuffle_reduction, select_strategy,
    vision_layers_run)
from mmparity.models.llava import native
from mmparity.models.llava.megatron import (
    FINAL_NORM, LANGUAGE_LAYER, MEGATRON, MERGER, PROJECTOR, VISION, WHY_NO_WHOLE, bind_language, bind_towers,
    language_pairs, language_tokens, whole_vlm_parts)
from mmparity.models.core import sublayers
from mmparity.models.core.layers import numbered_layers
from mmparity.models.llava.preprocess import (
    DEFAULT_IMAGE_TOKEN_INDEX, _precalculate_loss_weights, _preprocess_data, pixel_shuffle)
from mmparity.models.llava import reference
from mmparity.models.llava.reference import IGNORE_INDEX, OUTPUTS, PLACEHOLDER

COMPONENTS = ("pixel_shuffle", "loss_weights", "expansion")


def vision_pair_names(cfg) -> set[str]:
    """The vision family's paired modules that a LLaVA forward actually runs (a layer's name
    stands for its sub-modules' too)."""
    return {"patch_embed", "ln_pre"} | {f"layer.{i}" for i in range(vision_layers_run(cfg))}


def _runs(pair: Pair, run_names: set[str]) -> bool:
    return pair.name in run_names or sublayers.layer_of(pair.name, 2) in run_names


# --- the reference side (transformers) -----------------------------------------------------------


def tower_side(cfg, towers: TowerLookup) -> Optional[int]:
    """The most pixels per image side the tower takes for this config (None: any number)."""
    most = towers(cfg).llava_tower.max_patches
    return None if most is None else most(cfg.vision_config) * first_int(cfg.vision_config.patch_size)


def within_tower(cfg, sizes, towers: TowerLookup, step: int) -> list[tuple[int, int]]:
    """Default ``sizes`` cut to what the tower takes, sides kept multiples of ``step``."""
    side = tower_side(cfg, towers)
    return list(sizes) if side is None else inputs.within(sizes, side, step)


def image_size_problems(cfg, sizes, towers: TowerLookup) -> list[str]:
    """HF LLaVA runs fixed-size towers (CLIP, SigLIP) without position interpolation: only their
    own size works; a tower that takes several sizes takes what its own family allows."""
    vision = cfg.vision_config
    if towers(cfg).llava_tower.variable_size:
        return towers(cfg).config.image_size_problems(vision, sizes)
    side = image_hw(vision)
    return [f"image size {h}x{w}: a LLaVA {vision.model_type} tower only takes {side[0]}x{side[1]} "
            f"(HF does not interpolate its position embeddings here)" for h, w in sizes
            if (h, w) != side]


def tokens_per_image(cfg, size, towers: TowerLookup) -> int:
    """Image embedding slots per image: its patches, plus the class token(s) the tower prepends,
    minus the first token when the select strategy is ``default``."""
    p = first_int(cfg.vision_config.patch_size)
    r = pixel_shuffle_reduction(cfg)
    if r > 1:  # InternVL: the class token dropped, the patch grid shuffled r x r
        return (size[0] // p // r) * (size[1] // p // r)
    count = (size[0] // p) * (size[1] // p) + towers(cfg).llava_tower.class_token_len
    return count - (select_strategy(cfg) == "default")


def default_image_sizes(cfg, towers: TowerLookup) -> list[tuple[int, int]]:
    """Three images: odd, non-square grids where the tower takes any size, else its own size."""
    if towers(cfg).llava_tower.variable_size:
        p = first_int(cfg.vision_config.patch_size)
        return within_tower(cfg, [(3 * p, 5 * p), (5 * p, 2 * p), (2 * p, 4 * p)], towers, p)
    return [image_hw(cfg.vision_config)] * 3


def cases(cfg, seed: int, image_sizes=None, *, towers: TowerLookup,
          composition: "Composition" = None) -> list[Case]:
    """One batch of two rows: row 0 holds one image between text, row 1 one placeholder of two
    tiles (with the default sizes) between text; rows are padded with text to equal length. With
    explicit sizes every image is its own placeholder, the first half (rounded up) in row 0."""
    if composition is not None and composition.image_layout == ROWS:
        return row_layout_cases(cfg, seed, image_sizes, towers=towers)
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg, towers))]
    side = image_hw(cfg.vision_config)
    if not towers(cfg).llava_tower.variable_size and any(s != side for s in sizes):
        raise ValueError(f"HF LLaVA runs this {cfg.vision_config.model_type} tower at its "
                         f"configured image size {side[0]}x{side[1]} only")
    tiles = [1, 2] if image_sizes is None and len(sizes) == 3 else [1] * len(sizes)
    imgs = inputs.images(sizes, cfg.vision_config.num_channels, seed)
    ends = torch.tensor(tiles).cumsum(0).tolist()
    slots = [sum(tokens_per_image(cfg, s, towers) for s in sizes[end - n:end]) for n, end in zip(tiles, ends)]
    wrap = composition.image_wrap(cfg) if composition is not None and composition.image_wrap else None
    compact, hf_ids = _rows(cfg, slots, seed, wrap)
    length = len(hf_ids[0])
    data = {
        "images": imgs, "sizes": sizes, "num_image_tiles": tiles, "length": length,
        **_mcore_side(cfg, compact, seed),
        "hf_input_ids": torch.tensor(hf_ids),
    }
    data["hf_labels"] = data["hf_input_ids"].masked_fill(
        data["hf_input_ids"] == image_token_id(cfg), IGNORE_INDEX)
    described = ", ".join(f"{h}x{w}" for h, w in sizes)
    return [Case("sample", data, OUTPUTS,
                 description=f"2 rows of {length} tokens, images {described} in tiles {tiles}")]


def _text_tokens(cfg, count: int, gen, avoid=None) -> list[int]:
    """Seeded text ids, never the image token (HF would read it as an image slot) nor the other
    ids in ``avoid``."""
    avoid = sorted({image_token_id(cfg), *(avoid or ())})
    ids = torch.randint(0, cfg.text_config.vocab_size - len(avoid), (count,), generator=gen)
    for skipped in avoid:
        ids = ids + (ids >= skipped).long()
    return ids.tolist()


# --- the processor's layout: rows of [IMG], [IMG_BREAK] between rows, [IMG_END] last ------------

def row_layout_image_sizes(cfg, towers: TowerLookup) -> list[tuple[int, int]]:
    """Three images of odd, non-square token grids (cut to what the tower takes)."""
    px = processor.token_pixels(cfg)
    return within_tower(cfg, [(3 * px, 5 * px), (5 * px, 2 * px), (2 * px, 4 * px)], towers, px)


def row_layout_cases(cfg, seed: int, image_sizes=None, *, towers: TowerLookup) -> list[Case]:
    """Two rows of text with images where HF's Pixtral processor puts them: the first half of the
    images (rounded up) in row 0, the rest in row 1, text between; the processor resizes,
    normalises and expands each ``[IMG]``. The native side reads the same ids with every run of
    ``[IMG]`` (one image row) as one placeholder of that many slots; ``[IMG_BREAK]`` and
    ``[IMG_END]`` stay text, as in the ids HF reads."""
    sizes = [tuple(s) for s in (image_sizes or row_layout_image_sizes(cfg, towers))]
    px = processor.token_pixels(cfg)
    specials = processor.special_ids(cfg)
    raw = [_as_uint8(img) for img in inputs.images(sizes, cfg.vision_config.num_channels, seed)]
    first = (len(sizes) + 1) // 2
    placed = [list(range(first)), list(range(first, len(sizes)))]
    gen = inputs.generator(seed + 4099)
    segments = [[3 + b] + [2] * max(len(p) - 1, 0) + [4] for b, p in enumerate(placed)]
    expanded = [sum(seg) + sum(len(processor.image_tokens(*sizes[k], px)) for k in p)
                for seg, p in zip(segments, placed)]
    for b in range(2):
        segments[b][-1] += max(expanded) - expanded[b]
    texts = []
    for b in range(2):
        words = []
        for index, count in enumerate(segments[b]):
            words += [processor.word(t) for t in _text_tokens(cfg, count, gen, specials.all)]
            if index < len(placed[b]):
                words.append(processor.IMAGE)
        texts.append(" ".join(words))
    out = processor.process(cfg, texts, [[raw[k] for k in p] for p in placed],
                            longest_edge=max(max(s) for s in sizes))
    hf_ids, pixels, got_sizes = out["input_ids"], out["pixel_values"], out["image_sizes"].tolist()
    compact, counts = collapse_image_runs(hf_ids.tolist(), image_token_id(cfg))
    data = {
        "images": [pixels[k, :, :h, :w].contiguous() for k, (h, w) in enumerate(got_sizes)],
        "sizes": [tuple(size) for size in got_sizes], "num_image_tiles": None,
        "media_token_counts": counts, "length": hf_ids.shape[1],
        **_mcore_side(cfg, compact, seed),
        "hf_input_ids": hf_ids, "hf_pixel_values": pixels, "hf_image_sizes": out["image_sizes"],
    }
    data["hf_labels"] = hf_ids.masked_fill(hf_ids == image_token_id(cfg), IGNORE_INDEX)
    described = ", ".join(f"{h}x{w}" for h, w in data["sizes"])
    return [Case("sample", data, OUTPUTS,
                 description=f"2 rows of {hf_ids.shape[1]} tokens from the Pixtral processor, images "
                             f"{described}, {len(counts)} image rows")]


def _as_uint8(img: torch.Tensor) -> torch.Tensor:
    """A seeded float image as the 8-bit picture a processor is given."""
    low, high = img.min(), img.max()
    return ((img - low) / (high - low) * 255).round().to(torch.uint8)


def collapse_image_runs(rows: list[list[int]], image_token: int) -> tuple[list[list[int]], list[int]]:
    """HF ids -> mcore's compact ids (each run of ``image_token`` one placeholder) and the slots of
    each placeholder in reading order."""
    compact, counts = [], []
    for row in rows:
        out = []
        for token in row:
            if token != image_token:
                out.append(token)
            elif out and out[-1] == PLACEHOLDER:
                counts[-1] += 1
            else:
                out.append(PLACEHOLDER)
                counts.append(1)
        compact.append(out)
    return compact, counts


def _rows(cfg, slots: list[int], seed: int, wrap: Optional[tuple[int, int]] = None):
    """Compact rows (placeholders in reading order: the first half, rounded up, in row 0, the
    rest in row 1; text around each) and their HF expansion; the shorter row gets extra trailing
    text so both rows have the same length.

    Placeholder k must be the k-th in reading order (row-major over the batch): that is the
    order in which both models consume the images. mcore's ``num_image_tiles`` and its image
    embeddings fill the placeholders row by row, and HF's ``masked_scatter`` fills the flattened
    image-token mask with the concatenated image features, checking only the total count. A
    layout that puts image k anywhere else (e.g. round-robin over the rows) gives each side a
    different, equally wrong, input: the native rows expand to other lengths, and HF silently
    spreads one image's features over another image's slots.

    ``wrap``: the ids of the text tokens that open and close every image's run (InternVL's
    ``<img>`` / ``</img>``), text on both sides; none elsewhere.
    """
    gen = inputs.generator(seed + 4099)
    first = (len(slots) + 1) // 2
    placed = [list(range(first)), list(range(first, len(slots)))]
    segments = [[3 + b] + [2] * max(len(p) - 1, 0) + [4] for b, p in enumerate(placed)]
    opening, closing = ([wrap[0]], [wrap[1]]) if wrap else ([], [])
    expanded = [sum(s) + sum(slots[k] + len(opening) + len(closing) for k in p) for s, p in zip(segments, placed)]
    for b in range(2):
        segments[b][-1] += max(expanded) - expanded[b]
    compact, hf = [], []
    for b in range(2):
        row, hf_row = [], []
        for index, segment in enumerate(segments[b]):
            words = _text_tokens(cfg, segment, gen, wrap)
            row += words
            hf_row += words
            if index < len(placed[b]):
                row += [*opening, PLACEHOLDER, *closing]
                hf_row += [*opening, *[image_token_id(cfg)] * slots[placed[b][index]], *closing]
        compact.append(row)
        hf.append(hf_row)
    return compact, hf


def _mcore_side(cfg, compact: list[list[int]], seed: int) -> dict:
    """mcore's compact batch: ids, pre-shifted labels (the next compact id) and loss mask.

    Rows whose images take fewer slots are longer in compact form; they are padded with text to
    a rectangle, which expands past the HF row's end (the native side keeps the first
    ``length`` positions). Each row's final real token has no next token to check against in
    the HF row, so its loss is masked, and so is the padding.
    """
    gen = inputs.generator(seed + 8191)
    width = max(len(r) for r in compact)
    ids = torch.tensor([r + _text_tokens(cfg, width - len(r), gen) for r in compact])
    after = torch.tensor(_text_tokens(cfg, ids.shape[0], gen)).view(-1, 1)
    labels = torch.cat([ids[:, 1:], after], dim=1)
    loss_mask = torch.zeros(ids.shape)
    for b, row in enumerate(compact):
        loss_mask[b, : len(row) - 1] = 1
    return {"input_ids": ids, "labels": labels, "loss_mask": loss_mask}


def prepare_case(case: Case, cfg, towers: TowerLookup) -> Case:
    return towers(cfg).parity.prepare_case(case, cfg.vision_config)


def _pixel_values(cfg, case: Case, dtype, device, towers: TowerLookup) -> dict:
    if "hf_pixel_values" in case.data:  # the processor's own batch
        return {"pixel_values": case.data["hf_pixel_values"].to(device, dtype),
                "image_sizes": case.data["hf_image_sizes"]}
    if towers(cfg).llava_tower.variable_size:
        batch, sizes = inputs.pad_batch(case.data["images"])
        return {"pixel_values": batch.to(device, dtype), "image_sizes": torch.tensor(sizes)}
    return {"pixel_values": torch.stack(case.data["images"]).to(device, dtype)}


def expected_loss_mask(hf_ids: torch.Tensor, image_token_index: int) -> torch.Tensor:
    """mcore's expanded loss mask from HF ids: text followed by text (so never the final token)."""
    text = hf_ids != image_token_index
    mask = torch.zeros_like(text)
    mask[:, :-1] = text[:, :-1] & text[:, 1:]
    return mask


def reference_run(model, case: Case, towers: TowerLookup) -> dict:
    cfg = model.config
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    hf_ids = case.data["hf_input_ids"].to(device)
    out = model(input_ids=hf_ids, **_pixel_values(cfg, case, dtype, device, towers))
    logits = out.logits.float()
    vocab = logits.shape[-1]
    # HF's causal-LM loss before reduction: position p predicts labels[p + 1].
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, vocab),
                              case.data["hf_labels"][:, 1:].reshape(-1).to(device),
                              ignore_index=IGNORE_INDEX, reduction="none").view(hf_ids.shape[0], -1)
    per_token = torch.cat([shifted, shifted.new_zeros(hf_ids.shape[0], 1)], dim=1)
    mask = expected_loss_mask(hf_ids, image_token_id(cfg))
    return {"logits": logits.reshape(-1, vocab),
            "loss_mask": mask.reshape(-1).float(),
            "token_loss": (per_token * mask).reshape(-1)}


def reference_pairs(model, cfg, towers: TowerLookup, languages: Callable) -> list[Pair]:
    run_names = vision_pair_names(cfg)
    out = [p.under(VISION)
           for p in towers(cfg).reference.pairs(model.model.vision_tower, cfg.vision_config)
           if _runs(p, run_names)]
    projector = model.model.multi_modal_projector
    if has_patch_merger(cfg):
        out.append(Pair(MERGER, projector.patch_merger, tokens_2d))
    out.append(Pair(PROJECTOR, projector, tokens_2d))
    for i, layer in enumerate(model.model.language_model.layers):
        out += sublayers.layer_pairs(LANGUAGE_LAYER.format(i), layer, tokens_2d, sublayers.HF_DECODER,
                                     inner=partial(languages(cfg).mlp_pairs(hf=True), extract=tokens_2d))
    out.append(Pair(FINAL_NORM, model.model.language_model.norm, tokens_2d))
    return out


# Packed-sample loss weights worked out by hand, in the order of LOSS_WEIGHT_CASES.
PINNED_LOSS_WEIGHTS = ([0.25, 0, 0.125, 0.125, 0.125, 0.125, 0, 0.25], [0, 0, 0.5, 0.5],
                       [0.5, 0, 0.5], [0.5, 0.5, 0])


def expansion_reference(vocab_size: int, seed: int) -> torch.Tensor:
    """[ids, labels, loss mask] after expansion, from the HF convention.

    HF's processor repeats each image token once per slot; its labels are the ids with -100 on
    image tokens, shifted inside the loss. mcore's label at p is therefore HF's at p + 1, with
    two differences: the last image slot still carries the next text token but is masked (HF
    trains it), and the final token keeps its own pre-shifted label, masked (its loss mask is 0).
    Rows are right-padded with id 0, label -100, mask 0.
    """
    ids, labels = inputs.compact_llava_batch(vocab_size, seed, PLACEHOLDER)
    tiles = iter(inputs.EXPANSION_TILES)
    rows = []
    for b in range(ids.shape[0]):
        hf = []
        for token in ids[b].tolist():
            hf += [PLACEHOLDER] * (next(tiles) * inputs.EXPANSION_SLOTS_PER_TILE) if token == PLACEHOLDER else [token]
        n = len(hf)
        is_text = [t != PLACEHOLDER for t in hf]
        row_labels, row_mask = [], []
        for p in range(n):
            if p == n - 1:
                row_labels.append(int(labels[b, -1]))
                row_mask.append(0)
            elif not is_text[p + 1]:
                row_labels.append(IGNORE_INDEX)
                row_mask.append(0)
            else:
                row_labels.append(hf[p + 1])
                row_mask.append(int(is_text[p]))
        rows.append((hf, row_labels, row_mask))
    width = max(len(r[0]) for r in rows)
    out = torch.zeros(3, len(rows), width)
    out[1] = IGNORE_INDEX
    for b, (hf, row_labels, row_mask) in enumerate(rows):
        out[0, b, : len(hf)] = torch.tensor(hf, dtype=torch.float32)
        out[1, b, : len(hf)] = torch.tensor(row_labels, dtype=torch.float32)
        out[2, b, : len(hf)] = torch.tensor(row_mask, dtype=torch.float32)
    return out


def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name == "pixel_shuffle":
        hidden = cfg.vision_config.hidden_size
        x = inputs.token_probe(24, hidden, seed).view(1, 4, 6, hidden)
        # Model code, imported where it runs: loading the hooks (to write torch_dist) does not pay for it.
        from transformers.models.internvl.modeling_internvl import InternVLModel

        # InternVL's method reads nothing from self.
        return InternVLModel.pixel_shuffle(None, x, 0.5).reshape(-1, 4 * hidden)
    if name == "loss_weights":
        return torch.tensor([w for case in PINNED_LOSS_WEIGHTS for w in case])
    if name == "expansion":
        return expansion_reference(cfg.text_config.vocab_size, seed)
    raise KeyError(name)


# --- the native side (mcore) ---------------------------------------------------------------------


def vision_input(model, case, dtype, device):
    """Equal-size images as a static batch, mixed sizes as one packed pass with their sizes."""
    imgs, sizes = case.data["images"], [tuple(s) for s in case.data["sizes"]]
    if len(set(sizes)) == 1:
        return torch.stack(imgs).to(device, dtype), None
    return inputs.packed_rows(imgs, model.vision_patch_dim).to(device, dtype), sizes


def native_run(model, case) -> dict:
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    images, sizes = vision_input(model, case, dtype, device)
    ids = case.data["input_ids"].to(device)
    common = dict(num_image_tiles=case.data["num_image_tiles"], imgs_sizes=sizes,
                  media_token_counts=case.data.get("media_token_counts"))
    logits = model(images, ids, None, None, runtime_gather_output=True, **common)
    with_loss = model(images, ids, None, None, labels=case.data["labels"].to(device),
                      loss_mask=case.data["loss_mask"].to(device), **common)
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    loss, mask = with_loss
    # Compact rows padded to a rectangle expand past the HF rows; causality keeps the positions
    # before the cut independent of what follows.
    keep, vocab = case.data["length"], model.vocab_size
    mask = mask[:, :keep]
    return {"logits": logits[:, :keep, :vocab].reshape(-1, vocab),
            "loss_mask": mask.reshape(-1).float(),
            "token_loss": (loss[:, :keep] * mask).reshape(-1)}


def native_pairs(model, cfg, towers: TowerLookup, languages: Callable) -> list:
    out = []
    if model.vision_model is not None:
        run_names = vision_pair_names(cfg)
        out += [p.under(VISION)
                for p in towers(cfg).native.pairs(model.vision_model, cfg.vision_config)
                if _runs(p, run_names)]
        if model.vision_model.merger is not None:
            out.append(Pair(MERGER, model.vision_model.merger, tokens_2d))
    if model.vision_projection is not None:
        out.append(Pair(PROJECTOR, model.vision_projection, tokens_2d))
    out += language_pairs(model.language_model, languages(cfg).mlp_pairs(hf=False))
    return out


# (boundaries, labels) of packed samples whose loss weights PINNED_LOSS_WEIGHTS states.
LOSS_WEIGHT_CASES = (([0, 2, 6, 8], [1, -100, 2, 3, 4, 5, -100, 6]),
                     ([0, 2, 4], [-100, -100, 1, 2]),
                     ([0, 2, 9], [1, -100, 2]),
                     ([0, 0, 2, 3], [1, 2, -100]))


def expansion_inputs(vocab_size: int, seed: int):
    """The shared compact batch (``cases.inputs.compact_llava_batch``) and a loss mask that is 0
    on the last token."""
    ids, labels = inputs.compact_llava_batch(vocab_size, seed, DEFAULT_IMAGE_TOKEN_INDEX)
    loss_mask = torch.ones(ids.shape)
    loss_mask[:, -1] = 0
    return ids, labels, loss_mask


def native_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name == "pixel_shuffle":
        # A 4x6 grid: non-square, and even on both sides as the 2x2 neighbourhoods need.
        x = inputs.token_probe(24, model.vision_model.hidden_size, seed).unsqueeze(0)
        return pixel_shuffle(x, 0.5, h=4, w=6)[0]
    if name == "loss_weights":
        return torch.cat([_precalculate_loss_weights(b, l) for b, l in LOSS_WEIGHT_CASES])
    if name == "expansion":
        ids, labels, loss_mask = expansion_inputs(cfg.text_config.vocab_size, seed)
        out = _preprocess_data(None, None, ids, loss_mask, labels, DEFAULT_IMAGE_TOKEN_INDEX,
                               list(inputs.EXPANSION_TILES), img_seq_len=inputs.EXPANSION_SLOTS_PER_TILE,
                               pre_process=False)
        return torch.stack([out.input_ids.float(), out.labels.float(), out.loss_mask.float()])
    raise KeyError(name)


# --- the registry's record -------------------------------------------------------------------------

def random_text(pick, config_class, vocabs, **fixed):
    """A random dense-decoder text config and its vocabulary and tied flag: GQA, a head_dim that is
    not hidden/heads, a vocabulary from ``vocabs``, tied or untied head; ``fixed`` as given."""
    groups = pick([1, 2])
    heads = groups * pick([1, 2, 3])
    vocab = pick(vocabs)
    tied = pick([False, True])
    # transformers insists on hidden % heads == 0 even with an explicit head_dim
    text = config_class(vocab_size=vocab, hidden_size=heads * 4 * pick([1, 2, 3]),
                        intermediate_size=2 * pick(range(1, 13)), num_hidden_layers=pick([1, 2]),
                        num_attention_heads=heads, num_key_value_heads=groups, head_dim=pick([4, 6]),
                        tie_word_embeddings=tied, **fixed)
    return text, vocab, tied


def random_config(pick):
    """Whole-LLaVA configs on the tiny Pixtral tower: tower depth, feature layers, GQA, a head_dim
    that is not hidden/heads, a vocabulary that needs padding or not, tied head, projector bias.
    (tests/models/test_llava_model.py also varies the tower family.)"""
    vision = reference.tiny_config().vision_config
    vision.num_hidden_layers = pick(range(1, 4))
    index = range(-(vision.num_hidden_layers + 1), vision.num_hidden_layers + 1)
    feature_layer = pick(index)
    if pick([False, True]):
        feature_layer = [feature_layer, pick(index)]
    text, vocab, tied = random_text(pick, LlamaConfig, [5, 101, 128, 257])
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=pick(range(vocab)),
                       vision_feature_layer=feature_layer, vision_feature_select_strategy="full",
                       multimodal_projector_bias=pick([False, True]), tie_word_embeddings=tied)


def published_pixtral_mistral(source: str, *, patch: int, image_size: int, ffn: int, positions: int,
                              projector_bias: bool, batch: tuple) -> Published:
    """A released Pixtral-tower + Mistral-decoder VLM for the bench: the 24 x 1024 tower and the
    40 x 5120 decoder (GQA 32/8, head 128, vocabulary 131072) that Pixtral-12B and
    Mistral-Small-3.1 share, with what differs between them."""
    return Published(
        source=source,
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16, head_dim=64, image_size=image_size, patch_size=patch,
                    num_channels=3, hidden_act="silu"),
        parent={"text_config.hidden_size": 5120, "text_config.intermediate_size": ffn,
                "text_config.num_hidden_layers": 40, "text_config.num_attention_heads": 32,
                "text_config.num_key_value_heads": 8, "text_config.head_dim": 128,
                "text_config.vocab_size": 131072, "text_config.rms_norm_eps": 1e-5,
                "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 1e9},
                "text_config.max_position_embeddings": positions,
                "multimodal_projector_bias": projector_bias},
        images=batch[0], image_size=batch[1], note="whole forward, language model included")


# What Megatron's default class has no place for, kept beside its state dict (the side file), on
# the config its layout is measured on: tests/models/test_upstream.py holds the converter to it.
# The CLIP tower's layer past vision_feature_layer (Megatron builds the tower that deep) and
# ln_post; tests/models/test_upstream.py's test_llava_keeps_aside_what_megatron_has_no_place_for says more.
SIDE_TENSORS = frozenset({f"vision_model.decoder.layers.1.{k}" for k in (
    "mlp.linear_fc1.bias", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight", "mlp.linear_fc2.bias", "mlp.linear_fc2.weight",
    "self_attention.linear_proj.bias", "self_attention.linear_proj.weight",
    "self_attention.linear_qkv.bias", "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight")}
    | {"vision_model.ln_post.weight", "vision_model.ln_post.bias"})


# How a whole VLM lays its images out among the text ids.
PLACEHOLDERS = "placeholders"  # one run of image tokens per image (LLaVA's processors)
ROWS = "pixtral_rows"  # the Pixtral processor's rows: [IMG]… [IMG_BREAK] … [IMG_END]


@dataclass(frozen=True)
class Composition:
    """What distinguishes one whole VLM from another on top of the shared parts (the registered
    tower, the projector, the dense decoder): the image-token layout its processor produces, and
    how its tower is built when it is not the tower family's own (Mistral3's carries the merger)."""

    image_layout: str = PLACEHOLDERS
    # (whole config, tower config, params_dtype) -> the native tower; None: the tower family's.
    build_tower: Optional[Callable] = None
    random_config: Optional[Callable] = None
    published: Optional[Published] = None
    # Megatron's classes for it (``check --impl megatron``, ``verify --load``); None: its language
    # model and projector parts (:func:`whole_vlm_parts`).
    megatron: Optional[MegatronClasses] = None
    # (whole config) -> the ids of the text tokens around each image's run (InternVL's <img> and
    # </img>); None: the runs stand alone.
    image_wrap: Optional[Callable] = None


def row_layout_size_problems(cfg, sizes, towers: TowerLookup) -> list[str]:
    px = processor.token_pixels(cfg)
    return [f"image size {h}x{w}: the Pixtral processor's tokens are {px} pixels, so both sides "
            f"must be multiples of {px}" for h, w in sizes if h % px or w % px] + \
        towers(cfg).config.image_size_problems(cfg.vision_config, sizes)


# LLaVA itself: the placeholder layout, the tower family's tower, stock LLaVAModel first.
LLAVA = Composition(megatron=MEGATRON)


def hooks(towers: TowerLookup, languages: Callable, composition: Composition = LLAVA,
          reference_module=reference) -> FamilyHooks:
    """The record of a whole VLM composed of a registered tower (``towers(cfg)``: the tower
    family's hooks) and a registered language model (``languages(cfg)``: the part's record)."""
    def build_native(cfg, params_dtype=torch.float32):
        tower = towers(cfg)
        build_tower = (tower.native.build if composition.build_tower is None
                       else partial(composition.build_tower, cfg))
        return native.build_native(cfg, params_dtype, build_tower=build_tower,
                                   tower_packs_images=tower.llava_tower.variable_size,
                                   tower_name=tower.llava_tower.model_type,
                                   language=languages(cfg).native)

    def tower_of(cfg) -> converter.Tower:
        tower = towers(cfg)
        return converter.Tower(tower.converter, tower.llava_tower.v4_checkpoint_root)

    rows = composition.image_layout == ROWS
    return FamilyHooks(
        config=ConfigHooks(
            tiny=reference_module.tiny_config, family_config=reference_module.vision_config,
            random=composition.random_config or random_config,
            image_size_multiple=processor.token_pixels if rows else None,
            image_size_problems=partial(row_layout_size_problems if rows else image_size_problems, towers=towers)),
        reference=Side(partial(reference_run, towers=towers), partial(reference_pairs, towers=towers, languages=languages),
                       reference_component, reference_module.build),
        native=Side(native_run, partial(native_pairs, towers=towers, languages=languages), native_component,
                    build_native),  # the tower comes from towers
        converter=converter.converter(tower_of, lambda cfg: languages(cfg).converter,
                                      getattr(reference_module, "HF_LAYOUTS", converter.FORMATS)),
        parity=Parity(partial(cases, towers=towers, composition=composition),
                      partial(prepare_case, towers=towers), COMPONENTS),
        megatron=bind_towers(bind_language(composition.megatron if composition.megatron is not None
                                           else whole_vlm_parts(why=WHY_NO_WHOLE), languages), towers),
        bench=Bench(published=composition.published))
