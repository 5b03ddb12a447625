"""Reference side of LLaVA: transformers' ``LlavaForConditionalGeneration`` on expanded ids.

A case holds one batch in both conventions. The native side reads mcore's: compact ids with one
placeholder per image (``-200``), pre-shifted labels, a loss mask. HF reads what its processor
emits: every placeholder expanded into one image token per embedding slot, labels unshifted with
-100 on image tokens. Compared outputs:

* ``logits`` at every position, over the real vocabulary;
* ``loss_mask``: mcore's expanded mask, here derived from the HF convention (a position trains
  iff it is text and the next token is text; mcore also masks the last image slot, which HF
  trains, and the final token, which has no next token inside the row);
* ``token_loss``: HF's shifted per-token cross entropy at the positions the mask keeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, PixtralVisionConfig

from mmparity import families
from mmparity.converters import llava as llava_config
from mmparity.parity import inputs
from mmparity.parity.cases import Case, Pair, tokens_2d

MODEL_TYPES = ("llava",)
OUTPUTS = ("logits", "loss_mask", "token_loss")
IGNORE_INDEX = -100
PLACEHOLDER = -200  # mcore's DEFAULT_IMAGE_TOKEN_INDEX in compact ids
# Vision towers whose HF LLaVA forward takes images of several sizes at once (with image_sizes);
# the others need every image at the tower's configured size.
VARIABLE_SIZE_TOWERS = ("pixtral",)


def tiny_config() -> LlavaConfig:
    """Pixtral tower (3 layers, features from the penultimate one), Llama decoder with GQA and a
    head_dim that is not hidden/heads, a vocabulary that needs padding (101 -> 128), projector
    biases, untied embeddings, a non-default RoPE base."""
    vision = PixtralVisionConfig(hidden_size=48, intermediate_size=44, num_hidden_layers=3,
                                 num_attention_heads=4, image_size=64, patch_size=8,
                                 hidden_act="silu", num_channels=3)
    text = LlamaConfig(vocab_size=101, hidden_size=40, intermediate_size=52, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                       rms_norm_eps=1e-6, max_position_embeddings=256, hidden_act="silu",
                       rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                       tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=71,
                       projector_hidden_act="gelu", vision_feature_layer=-2,
                       vision_feature_select_strategy="full", multimodal_projector_bias=True,
                       tie_word_embeddings=False)


def image_size_problems(cfg, sizes) -> list[str]:
    """HF LLaVA runs CLIP/SigLIP towers without position interpolation: only their own size works."""
    vision = cfg.vision_config
    if vision.model_type not in ("clip_vision_model", "siglip_vision_model"):
        return []
    side = vision.image_size
    return [f"image size {h}x{w}: a LLaVA {vision.model_type} tower only takes {side}x{side} "
            f"(HF does not interpolate its position embeddings here)" for h, w in sizes
            if (h, w) != (side, side)]


def vision_config(cfg):
    """The family config: a ``LlavaConfig`` itself (the whole model is this family's subject)."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a LLaVA model")


def build(cfg) -> LlavaForConditionalGeneration:
    model = LlavaForConditionalGeneration(cfg).eval()
    if llava_config.tied(cfg):
        # A tied checkpoint stores the table once (save_pretrained omits lm_head.weight); accept
        # that in strict loads by reading the head from the embedding.
        def fill_tied_head(state_dict, prefix, *unused):
            head, embed = prefix + "lm_head.weight", prefix + "model.language_model.embed_tokens.weight"
            if head not in state_dict and embed in state_dict:
                state_dict[head] = state_dict[embed]

        model._register_load_state_dict_pre_hook(fill_tied_head)
    return model


def _vision_reference(cfg):
    return families.get(llava_config.vision_family(cfg)).reference()


def _patch(cfg) -> int:
    p = cfg.vision_config.patch_size
    return p if isinstance(p, int) else p[0]


def tokens_per_image(cfg, size) -> int:
    """Image embedding slots per image: its patches, plus the class token(s) the tower prepends,
    minus the first token when the select strategy is ``default``."""
    p = _patch(cfg)
    count = (size[0] // p) * (size[1] // p) + getattr(_vision_reference(cfg), "CLASS_TOKEN_LEN", 0)
    return count - (cfg.vision_feature_select_strategy == "default")


def _configured_size(cfg) -> tuple[int, int]:
    size = cfg.vision_config.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Three images: odd, non-square grids where the tower takes any size, else its own size."""
    if llava_config.vision_family(cfg) in VARIABLE_SIZE_TOWERS:
        p = _patch(cfg)
        return [(3 * p, 5 * p), (5 * p, 2 * p), (2 * p, 4 * p)]
    return [_configured_size(cfg)] * 3


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """One batch of two rows: row 0 holds one image between text, row 1 one placeholder of two
    tiles (with the default sizes) between text; rows are padded with text to equal length. With
    explicit sizes every image is its own placeholder, the first half (rounded up) in row 0."""
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg))]
    side = _configured_size(cfg)
    if llava_config.vision_family(cfg) not in VARIABLE_SIZE_TOWERS and any(s != side for s in sizes):
        raise ValueError(f"HF LLaVA runs this {cfg.vision_config.model_type} tower at its "
                         f"configured image size {side[0]}x{side[1]} only")
    tiles = [1, 2] if image_sizes is None and len(sizes) == 3 else [1] * len(sizes)
    imgs = inputs.images(sizes, cfg.vision_config.num_channels, seed)
    ends = torch.tensor(tiles).cumsum(0).tolist()
    slots = [sum(tokens_per_image(cfg, s) for s in sizes[end - n:end]) for n, end in zip(tiles, ends)]
    compact, hf_ids = _rows(cfg, slots, seed)
    length = len(hf_ids[0])
    data = {
        "images": imgs, "sizes": sizes, "num_image_tiles": tiles, "length": length,
        **_mcore_side(cfg, compact, seed),
        "hf_input_ids": torch.tensor(hf_ids),
    }
    data["hf_labels"] = data["hf_input_ids"].masked_fill(
        data["hf_input_ids"] == cfg.image_token_index, IGNORE_INDEX)
    described = ", ".join(f"{h}x{w}" for h, w in sizes)
    return [Case("sample", data, OUTPUTS,
                 description=f"2 rows of {length} tokens, images {described} in tiles {tiles}")]


def _text_tokens(cfg, count: int, gen) -> list[int]:
    """Seeded text ids, never the image token (HF would read it as an image slot)."""
    ids = torch.randint(0, cfg.text_config.vocab_size - 1, (count,), generator=gen)
    return (ids + (ids >= cfg.image_token_index).long()).tolist()


def _rows(cfg, slots: list[int], seed: int):
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
    """
    gen = inputs.generator(seed + 4099)
    first = (len(slots) + 1) // 2
    placed = [list(range(first)), list(range(first, len(slots)))]
    segments = [[3 + b] + [2] * max(len(p) - 1, 0) + [4] for b, p in enumerate(placed)]
    expanded = [sum(s) + sum(slots[k] for k in p) for s, p in zip(segments, placed)]
    for b in range(2):
        segments[b][-1] += max(expanded) - expanded[b]
    compact, hf = [], []
    for b in range(2):
        row, hf_row = [], []
        for index, segment in enumerate(segments[b]):
            words = _text_tokens(cfg, segment, gen)
            row += words
            hf_row += words
            if index < len(placed[b]):
                row.append(PLACEHOLDER)
                hf_row += [cfg.image_token_index] * slots[placed[b][index]]
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


def prepare_case(case: Case, cfg) -> Case:
    vision = _vision_reference(cfg)
    prepare = getattr(vision, "prepare_case", None)
    return prepare(case, cfg.vision_config) if prepare else case


def _pixel_values(cfg, case: Case, dtype, device) -> dict:
    if llava_config.vision_family(cfg) in VARIABLE_SIZE_TOWERS:
        batch, sizes = inputs.pad_batch(case.data["images"])
        return {"pixel_values": batch.to(device, dtype), "image_sizes": torch.tensor(sizes)}
    return {"pixel_values": torch.stack(case.data["images"]).to(device, dtype)}


def expected_loss_mask(hf_ids: torch.Tensor, image_token_index: int) -> torch.Tensor:
    """mcore's expanded loss mask from HF ids: text followed by text (so never the final token)."""
    text = hf_ids != image_token_index
    mask = torch.zeros_like(text)
    mask[:, :-1] = text[:, :-1] & text[:, 1:]
    return mask


def run(model, case: Case) -> dict:
    cfg = model.config
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    hf_ids = case.data["hf_input_ids"].to(device)
    out = model(input_ids=hf_ids, **_pixel_values(cfg, case, dtype, device))
    logits = out.logits.float()
    vocab = logits.shape[-1]
    # HF's causal-LM loss before reduction: position p predicts labels[p + 1].
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, vocab),
                              case.data["hf_labels"][:, 1:].reshape(-1).to(device),
                              ignore_index=IGNORE_INDEX, reduction="none").view(hf_ids.shape[0], -1)
    per_token = torch.cat([shifted, shifted.new_zeros(hf_ids.shape[0], 1)], dim=1)
    mask = expected_loss_mask(hf_ids, cfg.image_token_index)
    return {"logits": logits.reshape(-1, vocab),
            "loss_mask": mask.reshape(-1).float(),
            "token_loss": (per_token * mask).reshape(-1)}


def pairs(model, cfg) -> list[Pair]:
    vision = _vision_reference(cfg)
    run_names = llava_config.vision_pair_names(cfg)
    out = [Pair(f"vision.{p.name}", p.module, p.extract)
           for p in vision.pairs(model.model.vision_tower, cfg.vision_config) if p.name in run_names]
    out.append(Pair("projector", model.model.multi_modal_projector, tokens_2d))
    out += [Pair(f"layer.{i}", layer, tokens_2d)
            for i, layer in enumerate(model.model.language_model.layers)]
    out.append(Pair("final_norm", model.model.language_model.norm, tokens_2d))
    return out


COMPONENTS = ("pixel_shuffle", "loss_weights", "expansion")

# NOTES.md's pinned packed-sample loss weights, in the order of native LOSS_WEIGHT_CASES.
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


def component(name: str, model, cfg, seed: int) -> torch.Tensor:
    if name == "pixel_shuffle":
        from transformers.models.internvl.modeling_internvl import InternVLModel

        hidden = cfg.vision_config.hidden_size
        x = inputs.token_probe(24, hidden, seed).view(1, 4, 6, hidden)
        # InternVL's method reads nothing from self.
        return InternVLModel.pixel_shuffle(None, x, 0.5).reshape(-1, 4 * hidden)
    if name == "loss_weights":
        return torch.tensor([w for case in PINNED_LOSS_WEIGHTS for w in case])
    if name == "expansion":
        return expansion_reference(cfg.text_config.vocab_size, seed)
    raise KeyError(name)
