"""Inputs as HF's Pixtral processor makes them: a tiny tokenizer over the config's vocabulary, HF's
Pixtral image processor, and the processor's image-token layout (per image, rows of ``[IMG]``,
``[IMG_BREAK]`` after each row, the last replaced by ``[IMG_END]``).

transformers' ``PixtralProcessor`` module imports torchvision at import time, which has no wheel
beside the CPU torch this project pins. Where it imports, it is used as it is; otherwise its image
processor (the PIL backend, HF's own) and tokenizer run, and the text is expanded with the same
layout (:func:`image_tokens`). ``tests/test_pixtral_processor.py`` runs the real processor class
against this fallback token for token, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

IMAGE, BREAK, END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"


@dataclass(frozen=True)
class SpecialIds:
    image: int
    image_break: int
    image_end: int

    @property
    def all(self) -> tuple[int, int, int]:
        return (self.image, self.image_break, self.image_end)


def special_ids(cfg) -> SpecialIds:
    """``[IMG]`` is the config's image token; break and end take the two ids after it (as in the
    Pixtral release, 10 / 12 / 13, up to the gap), inside the text vocabulary."""
    image = cfg.image_token_index
    vocab = cfg.text_config.vocab_size
    after = [i for i in range(image + 1, image + 4) if i < vocab][:2]
    if len(after) < 2:
        raise ValueError(f"image_token_index {image} leaves no room for [IMG_BREAK] / [IMG_END] "
                         f"in a vocabulary of {vocab}")
    return SpecialIds(image, *after)


def word(token_id: int) -> str:
    return f"t{token_id}"


def tokenizer(cfg):
    """A word-level fast tokenizer: id k is the word ``t{k}``, the three image tokens special."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = special_ids(cfg)
    names = {ids.image: IMAGE, ids.image_break: BREAK, ids.image_end: END}
    vocab = {names.get(i, word(i)): i for i in range(cfg.text_config.vocab_size)}
    model = Tokenizer(models.WordLevel(vocab, unk_token=word(0)))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token=word(0),
                                   additional_special_tokens=[IMAGE, BREAK, END])


def image_processor(cfg, longest_edge: int):
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    return PixtralImageProcessorPil(size={"longest_edge": longest_edge}, patch_size=token_pixels(cfg))


def token_pixels(cfg) -> int:
    """Pixels per image token along a side: the patch, times the merge before the projector."""
    from mmparity.config import first_int, spatial_merge

    return first_int(cfg.vision_config.patch_size) * spatial_merge(cfg)


def real_processor(cfg, longest_edge: int):
    """transformers' ``PixtralProcessor`` over the tiny tokenizer, or None where it cannot import."""
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    except ImportError:
        return None
    from mmparity.config import first_int, spatial_merge

    return PixtralProcessor(image_processor=image_processor(cfg, longest_edge), tokenizer=tokenizer(cfg),
                            patch_size=first_int(cfg.vision_config.patch_size),
                            spatial_merge_size=spatial_merge(cfg))


def image_tokens(height: int, width: int, pixels_per_token: int) -> list[str]:
    """The processor's expansion of one ``[IMG]`` for an image of ``height`` x ``width`` pixels."""
    rows, cols = height // pixels_per_token, width // pixels_per_token
    tokens = ([IMAGE] * cols + [BREAK]) * rows
    tokens[-1] = END
    return tokens


def process(cfg, texts: Sequence[str], images: Sequence[Sequence[torch.Tensor]], longest_edge: int,
            *, use_real: bool = True) -> dict:
    """``texts`` (one per row, ``[IMG]`` where each image goes) and their ``images`` (uint8 CHW)
    -> ``input_ids`` [rows, tokens], ``pixel_values`` [images, C, Hmax, Wmax], ``image_sizes``."""
    processor = real_processor(cfg, longest_edge) if use_real else None
    if processor is not None:
        out = processor(text=list(texts), images=[list(row) for row in images], return_tensors="pt")
        return {k: out[k] for k in ("input_ids", "pixel_values", "image_sizes")}
    pixels = image_processor(cfg, longest_edge)([list(row) for row in images], return_tensors="pt")
    sizes = pixels["image_sizes"].tolist()
    expanded, index = [], 0
    for text in texts:
        words = []
        for piece in text.split():
            if piece == IMAGE:
                words += image_tokens(*sizes[index], token_pixels(cfg))
                index += 1
            else:
                words.append(piece)
        expanded.append(" ".join(words))
    ids = tokenizer(cfg)(expanded, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}
