"""Qwen3-VL whole on mcore, ``LLaVAModel``'s tree: the ``qwen3_vl`` family's tower (with its main and
DeepStack mergers; Qwen3-VL has no separate projector) as ``vision_model`` and a Qwen3 decoder as
``language_model`` (a ``GPTModel``).

The decoder is the dense decoder part's layer (its causal core attention, its TE-spelled linears)
with two Qwen3 differences: an RMSNorm over each head of q and of k before RoPE
(``self_attention.{q,k}_layernorm``, mcore's own places for them), and interleaved M-RoPE: three
position ids per token (t, h, w) and the rotary frequencies dealt out t h w t h w … over the first
``3·mrope_section[1]`` / ``3·mrope_section[2]`` frequencies, t for the rest; laid out rotate-half.
Position ids follow the processor's rule (text counts up by one; an image's tokens get t = start,
h = start + row, w = start + column of its merged grid, and the text after it continues at start +
the larger side), computed here from the ids and the grids. Video: the processor writes each
temporal patch of a clip as its own run of video tokens after timestamp text, so each gets one
frame's positions as an image does (the timestamps, not the positions, carry time).

DeepStack: feature ``k`` of the tower is added to the hidden states after decoder layer ``k`` at
the vision tokens (the images' and the clips', each modality's features at its own tokens). The features are made on the first pipeline stage with the tower and are not
sent on, so under pipeline parallelism the first ``len(deepstack_visual_indexes)`` decoder layers
must be on that stage. Images are laid out as Qwen's processor lays them out: one image token per
merged patch, between vision start / end tokens.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from mmparity.config import rope_theta
from mmparity.models.core.layers import (
    activation_from_hf, numbered_layers, tolerate_missing_extra_state, vision_transformer_config)
from mmparity.models.core.mla_moe import host_placement
from mmparity.models.core.stages import build_stage
from mmparity.models.llava.native import LLaVAModel
from mmparity.models.parts.dense_decoder.config import transformer_fields
from mmparity.models.parts.dense_decoder.native import language_layer_spec
from mmparity.models.qwen3_vl import native as tower


def mrope_section(text) -> List[int]:
    params = getattr(text, "rope_parameters", None) or {}
    return list(params.get("mrope_section", [24, 20, 20]))


def text_config_problems(text) -> list[str]:
    problems = []
    params = getattr(text, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        problems.append(f"rope_type {params.get('rope_type')!r} (only unscaled M-RoPE)")
    if len(mrope_section(text)) != 3:
        problems.append(f"mrope_section {mrope_section(text)} is not three sections (t, h, w)")
    if getattr(text, "attention_bias", False):
        problems.append("attention_bias=True (Qwen3-VL's decoder has none)")
    return problems


class InterleavedMRoPE(torch.nn.Module):
    """``forward(position_ids [3, b, s], mrope_section) -> [s, b, 1, d]`` rotate-half angles: the
    frequency ``j`` of the t, h or w position as ``j`` is dealt out (h at 1, 4, … below
    3·section[1], w at 2, 5, … below 3·section[2], t elsewhere). Frequencies are fp32 and stay so
    under a low-precision cast of the model, as in HF."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float)
                                                          / head_dim)), persistent=False)

    def _apply(self, fn, *args, **kwargs):
        fp32 = self.inv_freq
        out = super()._apply(fn, *args, **kwargs)
        self.inv_freq = fp32.to(self.inv_freq.device)
        return out

    @staticmethod
    def axes(half: int, section: Sequence[int], device=None) -> torch.Tensor:
        """Which position (0 t, 1 h, 2 w) each of the ``half`` frequencies reads."""
        axis = torch.zeros(half, dtype=torch.long, device=device)
        axis[1:3 * section[1]:3] = 1
        axis[2:3 * section[2]:3] = 2
        return axis

    def forward(self, position_ids: torch.Tensor, mrope_section: Sequence[int], cp_group=None) -> torch.Tensor:
        freqs = position_ids.to(self.inv_freq.device)[..., None].float() * self.inv_freq  # [3, b, s, d/2]
        axis = self.axes(freqs.shape[-1], mrope_section, freqs.device)
        picked = freqs.gather(0, axis.expand(1, *freqs.shape[1:3], -1)).squeeze(0)  # [b, s, d/2]
        return torch.cat([picked, picked], dim=-1).transpose(0, 1)[:, :, None, :].contiguous()


def vision_positions(start: int, t: int, gh: int, gw: int, interval=1, device=None) -> torch.Tensor:
    """``[3, t·gh·gw]`` positions of one vision run, its tokens listed temporal patch by temporal
    patch, each in raster order of its merged grid: t = start + ⌊k·interval⌋ for temporal patch
    ``k`` (the product taken in the interval's own type: an fp32 tensor rounds as transformers'
    does), h = start + row, w = start + column."""
    temporal = (torch.arange(t, device=device) * interval).long()
    per_frame = gh * gw
    return torch.stack([temporal.repeat_interleave(per_frame),
                        torch.arange(gh, device=device).repeat_interleave(gw).repeat(t),
                        torch.arange(gw, device=device).repeat(gh * t)]) + start


def mrope_position_ids(input_ids: torch.Tensor, image_token_id: int, grids: Sequence[Tuple[int, int]],
                       merge: int, *, video_token_id: Optional[int] = None,
                       video_grids: Sequence[Tuple[int, int, int]] = (), intervals=None) -> torch.Tensor:
    """``[3, b, s]`` (t, h, w) positions by transformers' ``get_rope_index`` rule: text counts up by
    one; each run of image tokens is the next image (``grids``: its (h, w) patch grid, one frame);
    each run of video tokens the next entry of ``video_grids`` ((t, h, w): t temporal patches of an
    h×w patch grid) with its temporal step from ``intervals`` (one per entry, default 1); each run
    holds exactly its merged patches (:func:`vision_positions`), and the text after a run continues
    at start + the larger merged side, whatever its temporal extent (as transformers counts)."""
    b, s = input_ids.shape
    out = torch.zeros(3, b, s, dtype=torch.long, device=input_ids.device)
    kinds = (input_ids == image_token_id).long()
    if video_token_id is not None:
        kinds = kinds + 2 * (input_ids == video_token_id).long()
    sources = {1: iter([(1, h, w) for h, w in grids]), 2: iter(list(video_grids))}
    steps = iter(list(intervals) if intervals is not None else [])
    names = {1: "image", 2: "video"}
    for row in range(b):
        marks = kinds[row].tolist()
        pos, i = 0, 0
        while i < s:
            j = i
            while j < s and marks[j] == marks[i]:
                j += 1
            kind = marks[i]
            if kind == 0:
                out[:, row, i:j] = torch.arange(pos, pos + j - i, device=out.device)
                pos += j - i
            else:
                try:
                    t, h, w = next(sources[kind])
                except StopIteration:
                    raise ValueError(f"more runs of {names[kind]} tokens in the ids than {names[kind]} "
                                     f"grids") from None
                step = next(steps, 1) if kind == 2 else 1
                gh, gw = h // merge, w // merge
                if j - i != t * gh * gw:
                    raise ValueError(f"a run of {j - i} {names[kind]} tokens for a {t}x{gh}x{gw} grid of "
                                     f"merged patches")
                out[:, row, i:j] = vision_positions(pos, t, gh, gw, step, out.device)
                pos += max(gh, gw)
            i = j
    return out


def video_runs(video_grids: Sequence[Tuple[int, int, int]], seconds=None, *, frames_apart: bool,
               tokens_per_second: float = 1) -> Tuple[list, Optional[list]]:
    """(the clips' (t, h, w) patch grids as runs of video tokens, one temporal step per run): with
    ``frames_apart`` (timestamp text between a clip's temporal patches) each temporal patch is a
    one-frame run (its step unused); else each clip is one run stepping ``tokens_per_second`` times
    its ``seconds`` per temporal patch, those fp32 as transformers holds them (1 where none given)."""
    if frames_apart:
        return [(1, h, w) for t, h, w in video_grids for _ in range(t)], None
    if seconds is None:
        return list(video_grids), [tokens_per_second] * len(video_grids)
    times = torch.as_tensor(seconds, dtype=torch.float32)
    if times.numel() != len(video_grids):
        raise ValueError(f"{times.numel()} seconds per temporal patch for {len(video_grids)} videos")
    return list(video_grids), [tokens_per_second * times[i] for i in range(len(video_grids))]


def language_spec():
    spec = language_layer_spec()
    attention = spec.submodules.self_attention.submodules
    attention.q_layernorm = WrappedTorchNorm
    attention.k_layernorm = WrappedTorchNorm
    return spec


def transformer_config(text, params_dtype: torch.dtype = torch.float32):
    problems = text_config_problems(text)
    if problems:
        raise ValueError("unsupported language model: " + "; ".join(problems))
    fields = transformer_fields(text)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, qk_layernorm=True,
                                     mrope_section=mrope_section(text), **fields)


def build_language_model(text, params_dtype, vocab_size: int, *, pre_process: bool, post_process: bool,
                         share_embeddings_and_output_weights: bool) -> GPTModel:
    config = transformer_config(text, params_dtype)
    model = GPTModel(config=config, transformer_layer_spec=language_spec(), vocab_size=vocab_size,
                     max_sequence_length=text.max_position_embeddings, pre_process=pre_process,
                     post_process=post_process, parallel_output=True,
                     share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                     position_embedding_type="rope", rotary_base=rope_theta(text),
                     scatter_embedding_sequence_parallel=False)
    # mcore's multimodal RoPE is the contiguous (Qwen2-VL) split and is built on CUDA; Qwen3's is
    # dealt out. Built as "rope", then switched: GPTModel's forward reads the kind at run time and
    # hands an "mrope" embedding the [3, b, s] position ids and the sections.
    model.position_embedding_type = "mrope"
    model.mrope_section = mrope_section(text)
    model.rotary_pos_emb = InterleavedMRoPE(config.kv_channels, rope_theta(text))
    return model


class Qwen3VLModel(MegatronModule):
    """ids, images and video clips -> logits or the per-token loss.

    Images: packed single-frame rows and their pixel sizes. Videos: packed processor rows (C·T·P·P,
    real frames in each temporal patch) and per clip ``(t, H, W)``: t temporal patches of H×W
    pixels. The tower runs the images, then the clips, as transformers does (a clip's temporal
    patches attend each within itself, so they run as t frames of one size); the merged features
    take the places of the image and the video tokens, and DeepStack features are added at both.

    Video positions: Qwen3-VL separates a clip's temporal patches by timestamp text, so each is its
    own run of video tokens with one frame's positions (:attr:`frames_apart`); Qwen2.5-VL keeps a
    clip one run whose temporal position steps by ``tokens_per_second`` times its seconds per
    temporal patch."""

    frames_apart = True

    def __init__(self, vision: Optional[tower.Qwen3VLViTModel], language_model: GPTModel, *,
                 image_token_id: int, vocab_size: int, merge: int, patch_dim: int,
                 video_token_id: Optional[int] = None, tokens_per_second: float = 1):
        super().__init__(config=language_model.config)
        self.vision_model = vision
        self.language_model = language_model
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self.image_token_id, self.vocab_size = image_token_id, vocab_size
        self.video_token_id, self.tokens_per_second = video_token_id, tokens_per_second
        self.merge, self.patch_dim = merge, patch_dim
        tolerate_missing_extra_state(self)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.language_model.set_input_tensor(input_tensor)

    def pipelined_module(self) -> torch.nn.Module:
        return self.language_model

    def image_features(self, rows: torch.Tensor, imgs_sizes) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """(merged features [N, h], DeepStack features [N, h] each, in layer order)."""
        hidden, h, w, taps = self.vision_model.encode_deepstack(rows, imgs_sizes=imgs_sizes)
        pooled = self.vision_model.merger(hidden, h, w)
        deep = self.vision_model.deepstack(taps, h, w)
        return pooled.reshape(-1, pooled.shape[-1]), [d.reshape(-1, d.shape[-1]) for d in deep]

    def video_positions(self, video_grids, seconds) -> Tuple[list, Optional[list]]:
        return video_runs(video_grids, seconds, frames_apart=self.frames_apart,
                          tokens_per_second=self.tokens_per_second)

    def _inject(self, features: List[torch.Tensor], image: torch.Tensor):
        """Forward hooks adding DeepStack feature ``k`` after decoder layer ``k`` at the vision
        tokens ``image`` (images' and videos')."""
        layers = numbered_layers(self.language_model.decoder)
        missing = sorted(set(range(len(features))) - {index for index, _ in layers})
        if missing:
            raise ValueError(f"DeepStack features for decoder layers {missing}, which are not on the "
                             f"first pipeline stage (the features are not sent on)")
        handles = []
        for index, layer in layers:
            if index < len(features):
                def add(_m, _i, out, feature=features[index]):
                    hidden = out[0].transpose(0, 1).clone()  # [b, s, h], a new tensor
                    hidden[image] = hidden[image] + feature.to(hidden.dtype)
                    return (hidden.transpose(0, 1).contiguous(), *out[1:])
                handles.append(layer.register_forward_hook(add))
        return handles

    def forward(self, rows: Optional[torch.Tensor], input_ids: torch.Tensor, *, imgs_sizes,
                labels: Optional[torch.Tensor] = None, video_rows: Optional[torch.Tensor] = None,
                video_sizes: Sequence[Tuple[int, int, int]] = (), video_seconds=None):
        # mcore's TP gather of the logits allocates on torch.cuda.current_device(): the host's here.
        with host_placement(input_ids.device):
            return self._forward(rows, input_ids, imgs_sizes, labels, video_rows, video_sizes, video_seconds)

    def _vision(self, batch_major, mask, rows, sizes, what: str):
        """Place the merged features of ``rows`` at ``mask``; -> the DeepStack features."""
        merged, deep = self.image_features(rows, sizes)
        if int(mask.sum()) != merged.shape[0]:
            raise ValueError(f"{int(mask.sum())} {what} tokens in the ids for {merged.shape[0]} {what} embeddings")
        batch_major[mask] = merged.to(batch_major.dtype)
        return deep

    def _forward(self, rows, input_ids, imgs_sizes, labels, video_rows, video_sizes, video_seconds):
        p = self.patch_dim
        grids = [(h // p, w // p) for h, w in imgs_sizes]
        video_grids = [(int(t), h // p, w // p) for t, h, w in video_sizes]
        runs, steps = self.video_positions(video_grids, video_seconds)
        positions = mrope_position_ids(input_ids, self.image_token_id, grids, self.merge,
                                       video_token_id=self.video_token_id, video_grids=runs, intervals=steps)
        image = input_ids == self.image_token_id
        video = (input_ids == self.video_token_id if self.video_token_id is not None
                 else torch.zeros_like(image))
        visual = image | video
        decoder_input, handles = None, []
        if self.pre_process:
            ids = input_ids.masked_fill(visual, 0)
            flat = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            embedded = self.language_model.embedding(input_ids=ids, position_ids=flat)  # [s, b, h]
            batch_major = embedded.transpose(0, 1).clone()
            deep_images = deep_videos = []
            if rows is not None:
                deep_images = self._vision(batch_major, image, rows, imgs_sizes, "image")
            if video_rows is not None:
                # A clip's temporal patches run as frames of its size, one after the other.
                frames = [(h, w) for t, h, w in video_sizes for _ in range(int(t))]
                deep_videos = self._vision(batch_major, video, video_rows, frames, "video")
            handles = self._inject(self._joint(deep_images, deep_videos, image, video), visual)
            decoder_input = batch_major.transpose(0, 1).contiguous()
        try:
            if labels is None or not self.post_process:
                return self.language_model(None, positions, None, decoder_input=decoder_input,
                                           runtime_gather_output=True)
            logits = self.language_model(None, positions, None, decoder_input=decoder_input)
            return LLaVAModel._token_loss(self, logits, labels.contiguous())
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def _joint(deep_images: list, deep_videos: list, image: torch.Tensor, video: torch.Tensor) -> list:
        """Per decoder layer, the DeepStack features of all vision tokens in token order: the
        images' at the image tokens, the videos' at the video tokens."""
        if not deep_videos:
            return deep_images
        if not deep_images:
            return deep_videos
        visual = image | video
        at_image, at_video = image[visual], video[visual]
        joint = []
        for of_images, of_videos in zip(deep_images, deep_videos):
            both = of_images.new_zeros(int(visual.sum()), of_images.shape[-1])
            both[at_image] = of_images
            both[at_video] = of_videos.to(both.dtype)
            joint.append(both)
        return joint


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Qwen3VLModel:
    text, vc = cfg.text_config, cfg.vision_config
    vision, language_model = build_stage(cfg, text, functools.partial(build_language_model, text, params_dtype),
                                         tower=lambda: tower.build_native(vc, params_dtype))
    model = Qwen3VLModel(vision, language_model, image_token_id=cfg.image_token_id,
                         vocab_size=text.vocab_size, merge=vc.spatial_merge_size,
                         patch_dim=int(vc.patch_size), video_token_id=cfg.video_token_id)
    return model.to(params_dtype)
