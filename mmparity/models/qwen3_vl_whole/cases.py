"""Qwen3-VL whole parity: two rows of text with three images of different sizes between vision
start / end tokens (one image token per merged patch, as Qwen's processor lays them out); then a
batch with a short clip (each temporal patch its own run of video tokens after timestamp text)
and images; logits at every position and the per-token loss, and the paired modules named by
Megatron's tree (the tower's as it ran last: on the clip in the video case): the
tower's (``vision_model.layer.N``, ``vision_model.deepstack_merger_list.J.…``,
``vision_model.merger.…``), then per decoder layer its attention and the layer itself (before the
DeepStack feature is added, on both sides), and the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from mmparity.config import first_int
from mmparity.models.core import inputs
from mmparity.models.core.inputs import next_tokens, token_mask
from mmparity.models.core import sublayers
from mmparity.models.core.layers import numbered_layers
from mmparity.parallel.pp import buildable_layer_counts
from mmparity.models.qwen3_5 import cases as frames
from mmparity.models.qwen3_vl import cases as tower_cases
from mmparity.models.qwen3_vl_whole import mapping as converter
from mmparity.models.qwen3_vl_whole import native, reference
from mmparity.models.qwen3_vl_whole.megatron import MEGATRON
from mmparity.models.spec import (
    Case, ConfigHooks, FamilyHooks, Pair, Parity, Side, sbh_tokens_2d, tokens_2d)

OUTPUTS = ("logits", "token_loss")
LANGUAGE_LAYER = "language_model.decoder.layers.{}"


def image_size_multiple(cfg) -> int:
    vc = cfg.vision_config
    return int(vc.patch_size) * vc.spatial_merge_size


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    step = image_size_multiple(cfg)
    # Around the 5×5 position table of the tiny tower: inside it, wide, and tall beyond it.
    return [(step, 2 * step), (3 * step, step), (2 * step, 4 * step)]


def _text(cfg, count: int, gen) -> list[int]:
    special = sorted({cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id})
    allowed = [t for t in range(cfg.text_config.vocab_size) if t not in special]
    picks = torch.randint(0, len(allowed), (count,), generator=gen).tolist()
    return [allowed[p] for p in picks]


def _merged(cfg, size) -> int:
    step = image_size_multiple(cfg)
    return (size[0] // step) * (size[1] // step)


def _image_run(cfg, size) -> list[int]:
    return [cfg.vision_start_token_id] + [cfg.image_token_id] * _merged(cfg, size) + [cfg.vision_end_token_id]


def _vision_data(cfg, sizes, seed: int, ids: torch.Tensor) -> dict:
    vc = cfg.vision_config
    return {"layout": "frame_rows", "images": inputs.images(sizes, vc.in_channels, seed), "sizes": sizes,
            "patch": int(vc.patch_size), "merge": vc.spatial_merge_size, "input_ids": ids}


def _padded(cfg, rows, gen) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + _text(cfg, width - len(r), gen) for r in rows])


@dataclass(frozen=True)
class VideoLayout:
    """How a family's processor writes a clip into the text: with ``frames_apart`` (Qwen3-VL) each
    temporal patch is its own run of video tokens between vision start / end, after timestamp text
    (random text tokens stand for "<1.5 seconds>"); otherwise (Qwen2.5-VL) the clip is one run, and
    ``seconds`` per temporal patch set its temporal position step."""

    frames_apart: bool
    seconds: Optional[float] = None
    temporal_patches: int = 3


FRAMES_APART = VideoLayout(frames_apart=True)


def default_video_size(cfg) -> tuple[int, int]:
    """Wide, 2×3 merged patches a frame: past the tiny towers' position tables on one axis, and a
    partial window on the other for Qwen2.5-VL's."""
    step = image_size_multiple(cfg)
    return (2 * step, 3 * step)


def cases(cfg, seed: int, image_sizes=None, *, video: Optional[VideoLayout] = None) -> list[Case]:
    """The image batch; with ``video``, also the video batch (:func:`video_case`)."""
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg))]
    gen = inputs.generator(seed + 4099)
    first = (len(sizes) + 1) // 2
    rows = []
    for chunk in (sizes[:first], sizes[first:]):
        row = _text(cfg, 3, gen)
        for size in chunk:
            row += _image_run(cfg, size) + _text(cfg, 2, gen)
        rows.append(row)
    ids = _padded(cfg, rows, gen)
    described = ", ".join(f"{h}x{w}" for h, w in sizes)
    out = [Case("sample", _vision_data(cfg, sizes, seed, ids), OUTPUTS,
                description=f"2 rows of {ids.shape[1]} tokens, images {described} between the text")]
    if video is not None:
        out.append(video_case(cfg, seed, sizes, video))
    return out


def video_case(cfg, seed: int, sizes, layout: VideoLayout) -> Case:
    """Row 1: text, a clip of ``temporal_patches`` × temporal_patch_size distinct frames of an
    awkward size, text, the first image, text. Row 2: text and the other images between text. The
    images are single frames, the clip's temporal patches real pairs (triples …) of frames."""
    vc = cfg.vision_config
    frames_per_patch = first_int(vc.temporal_patch_size)
    t, (height, width) = layout.temporal_patches, default_video_size(cfg)
    gen = inputs.generator(seed + 8191)
    per_patch = _merged(cfg, (height, width))
    clip_ids: list[int] = []
    if layout.frames_apart:
        for _ in range(t):
            clip_ids += (_text(cfg, 2, gen) + [cfg.vision_start_token_id] + [cfg.video_token_id] * per_patch
                         + [cfg.vision_end_token_id])
    else:
        clip_ids = [cfg.vision_start_token_id] + [cfg.video_token_id] * (t * per_patch) + [cfg.vision_end_token_id]
    rows = [_text(cfg, 3, gen) + clip_ids + _text(cfg, 2, gen), _text(cfg, 2, gen)]
    for index, size in enumerate(sizes):
        rows[0 if index == 0 else 1] += _image_run(cfg, size) + _text(cfg, 2, gen)
    ids = _padded(cfg, rows, gen)
    data = _vision_data(cfg, sizes, seed + 5, ids)
    frames = inputs.images([(height, width)] * (t * frames_per_patch), vc.in_channels, seed + 6)
    data.update(videos=[torch.stack(frames)], video_sizes=[(t, height, width)], temporal=frames_per_patch)
    how = "timestamps between its temporal patches"
    if not layout.frames_apart:
        seconds = 1.0 if layout.seconds is None else layout.seconds
        data["video_seconds"] = [seconds]
        how = f"one run, {seconds} s per temporal patch"
    described = ", ".join(f"{h}x{w}" for h, w in sizes)
    return Case("video", data, OUTPUTS,
                description=f"2 rows of {ids.shape[1]} tokens: a {t * frames_per_patch}-frame {height}x{width} "
                            f"clip ({t} temporal patches; {how}) and images {described} between the text")


def video_rows(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The clips as the processor emits them: (ΣN, C·T·P·P) rows, temporal patch after temporal
    patch, each block-first, and ``video_grid_thw`` (clips, 3) in patches."""
    p, m, frames = case.data["patch"], case.data["merge"], case.data["temporal"]
    rows = []
    for clip, (t, _, _) in zip(case.data["videos"], case.data["video_sizes"]):
        rows += [inputs.block_first_patch_rows(clip[k * frames:(k + 1) * frames], p, m) for k in range(t)]
    grid_thw = torch.tensor([[t, h // p, w // p] for t, h, w in case.data["video_sizes"]])
    return torch.cat(rows), grid_thw


def loss_mask(case: Case, cfg) -> torch.Tensor:
    """Positions whose next token is text (neither an image's nor a clip's)."""
    ids = case.data["input_ids"]
    return token_mask(ids, cfg.image_token_id) & token_mask(ids, cfg.video_token_id)


# --- the reference side ----------------------------------------------------------------------------

def reference_run(model, case: Case) -> dict:
    cfg = model.config
    param = next(model.parameters())
    rows, grid_thw = frames.processor_rows(case, cfg.vision_config)
    ids = case.data["input_ids"].to(param.device)
    types = (ids == cfg.image_token_id).int()
    videos = {}
    if "videos" in case.data:
        clips, clip_thw = video_rows(case)
        types = types + 2 * (ids == cfg.video_token_id).int()
        videos = {"pixel_values_videos": clips.to(param.device, param.dtype),
                  "video_grid_thw": clip_thw.to(param.device)}
        if "video_seconds" in case.data:
            videos["second_per_grid_ts"] = torch.tensor(case.data["video_seconds"], dtype=torch.float32,
                                                        device=param.device)
    logits = model(input_ids=ids, pixel_values=rows.to(param.device, param.dtype),
                   image_grid_thw=grid_thw.to(param.device), mm_token_type_ids=types, **videos).logits.float()
    vocab = logits.shape[-1]
    mask = loss_mask(case, cfg).to(param.device)
    loss = F.cross_entropy(logits.reshape(-1, vocab), next_tokens(ids).reshape(-1), reduction="none")
    return {"logits": logits.reshape(-1, vocab), "token_loss": (loss.view(ids.shape) * mask).reshape(-1)}


def language_pairs(layers, *, hf: bool, names: sublayers.LayerNames = sublayers.HF_DECODER) -> list[Pair]:
    """Each decoder layer's norms, attention and MLP, then the layer (``core.sublayers``); the
    layer's own pair is a snapshot on the mcore side, where the next layer's residual add would
    change its output in place. ``names``: where the HF layer keeps them."""
    out = []
    for i, layer in layers:
        name = LANGUAGE_LAYER.format(i)
        if hf:
            out += sublayers.layer_pairs(name, layer, tokens_2d, names)
        else:
            pairs = sublayers.layer_pairs(name, layer, sbh_tokens_2d)
            out += pairs[:-1] + [Pair(name, layer, sbh_tokens_2d, snapshot=True)]
    return out


def reference_pairs(model, cfg, tower_pairs=tower_cases.reference_pairs, layer_pairs=language_pairs) -> list[Pair]:
    """HF's whole model: the tower's pairs (``tower_pairs``) under ``vision_model.``, each decoder
    layer's (``layer_pairs``), the final norm. Other Qwen-VL-shaped whole models pass their own."""
    out = [p.under("vision_model.") for p in tower_pairs(model.model.visual, cfg.vision_config)]
    out += layer_pairs(enumerate(model.model.language_model.layers), hf=True)
    out.append(Pair("language_model.decoder.final_layernorm", model.model.language_model.norm, tokens_2d))
    return out


# --- the native side ---------------------------------------------------------------------------------

def native_run(model, case) -> dict:
    param = next(model.parameters())
    rows = (frames.patch_rows(model.vision_model, case).to(param.device, param.dtype)
            if model.pre_process else None)
    ids = case.data["input_ids"].to(param.device)
    videos = {}
    if "videos" in case.data:
        videos = {"video_sizes": case.data["video_sizes"], "video_seconds": case.data.get("video_seconds")}
        if model.pre_process:
            videos["video_rows"] = video_rows(case)[0].to(param.device, param.dtype)
    logits = model(rows, ids, imgs_sizes=case.data["sizes"], **videos)
    loss = model(rows, ids, imgs_sizes=case.data["sizes"], labels=next_tokens(ids), **videos)
    if not model.post_process:
        return {}
    logits = logits[..., :model.vocab_size].float()
    mask = token_mask(case.data["input_ids"], model.image_token_id)
    if model.video_token_id is not None:
        mask &= token_mask(case.data["input_ids"], model.video_token_id)
    mask = mask.to(param.device)
    return {"logits": logits.reshape(-1, model.vocab_size), "token_loss": (loss.float() * mask).reshape(-1)}


def native_pairs(model, cfg, tower_pairs=tower_cases.native_pairs, layer_pairs=language_pairs) -> list[Pair]:
    """The native whole model's pairs, as :func:`reference_pairs` names them (this stage's)."""
    out = []
    if model.vision_model is not None:
        out += [p.under("vision_model.") for p in tower_pairs(model.vision_model, cfg.vision_config)]
    out += layer_pairs(numbered_layers(model.language_model.decoder), hf=False)
    if model.post_process:
        out.append(Pair("language_model.decoder.final_layernorm", model.language_model.decoder.final_layernorm,
                        sbh_tokens_2d))
    return out


def no_component(name, model, cfg, seed):
    raise KeyError(name)


def random_config(pick):
    heads = pick([2, 4])
    groups = pick([g for g in (1, 2) if heads % g == 0])
    head_dim = pick([8, 12])
    half = head_dim // 2
    h_sec = pick([1, 2])
    layers = pick([1, 2, 3])
    return reference.tiny_config(
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
        hidden_size=pick([24, 40]), num_hidden_layers=layers,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                         "mrope_section": [half - 2 * h_sec, h_sec, h_sec], "mrope_interleaved": True})


def config_problems(cfg) -> list[str]:
    problems = [f"text_config: {p}" for p in native.text_config_problems(cfg.text_config)]
    return problems + tower_cases.config_problems(cfg.vision_config)


def pipeline_problems(cfg, pp: int) -> list[str]:
    """The DeepStack features are made on the first stage (the tower's) and are not sent on: the
    decoder layers they are added after must all be there."""
    if pp <= 1:
        return []
    first = buildable_layer_counts(cfg.text_config.num_hidden_layers, pp)[0]
    taps = len(cfg.vision_config.deepstack_visual_indexes)
    if taps <= first:
        return []
    return [f"--pp {pp}: the first stage holds {first} decoder layers but the {taps} DeepStack features "
            f"are added after the first {taps}; check at a --pp that leaves {taps} layers on the first "
            f"stage (convert takes any --pp)"]


def image_size_problems(cfg, sizes) -> list[str]:
    step = image_size_multiple(cfg)
    bad = [s for s in sizes if s[0] % step or s[1] % step or min(s) <= 0]
    return [f"image sizes {bad} are not positive multiples of patch_size*spatial_merge_size = {step}"] if bad else []


def hooks(towers) -> FamilyHooks:
    return FamilyHooks(
        config=ConfigHooks(tiny=reference.tiny_config, family_config=reference.vision_config, random=random_config,
                           problems=config_problems, image_size_multiple=image_size_multiple,
                           image_size_problems=image_size_problems, pipeline_problems=pipeline_problems),
        reference=Side(reference_run, reference_pairs, no_component, reference.build),
        native=Side(native_run, native_pairs, no_component, native.build_native), converter=converter.SPEC,
        parity=Parity(partial(cases, video=FRAMES_APART)), megatron=MEGATRON)
