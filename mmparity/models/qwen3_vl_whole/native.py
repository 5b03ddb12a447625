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
the larger side), computed here from the ids and the grids.

DeepStack: feature ``k`` of the tower is added to the hidden states after decoder layer ``k`` at
the image tokens. The features are made on the first pipeline stage with the tower and are not
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


def mrope_position_ids(input_ids: torch.Tensor, image_token_id: int, grids: Sequence[Tuple[int, int]],
                       merge: int) -> torch.Tensor:
    """``[3, b, s]`` (t, h, w) positions: each run of image tokens is the next image (one frame,
    ``grids`` its patch grid) and holds exactly its merged patches."""
    b, s = input_ids.shape
    out = torch.zeros(3, b, s, dtype=torch.long, device=input_ids.device)
    images = iter(grids)
    for row in range(b):
        is_image = (input_ids[row] == image_token_id).tolist()
        pos, i = 0, 0
        while i < s:
            j = i
            while j < s and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                out[:, row, i:j] = torch.arange(pos, pos + j - i, device=out.device)
                pos += j - i
            else:
                try:
                    h, w = next(images)
                except StopIteration:
                    raise ValueError("more runs of image tokens in the ids than images") from None
                gh, gw = h // merge, w // merge
                if j - i != gh * gw:
                    raise ValueError(f"a run of {j - i} image tokens for an image of {gh}x{gw} merged patches")
                out[0, row, i:j] = pos
                out[1, row, i:j] = torch.arange(gh, device=out.device).repeat_interleave(gw) + pos
                out[2, row, i:j] = torch.arange(gw, device=out.device).repeat(gh) + pos
                pos += max(gh, gw)
            i = j
    return out


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
    def __init__(self, vision: Optional[tower.Qwen3VLViTModel], language_model: GPTModel, *,
                 image_token_id: int, vocab_size: int, merge: int, patch_dim: int):
        super().__init__(config=language_model.config)
        self.vision_model = vision
        self.language_model = language_model
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self.image_token_id, self.vocab_size = image_token_id, vocab_size
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

    def _inject(self, features: List[torch.Tensor], image: torch.Tensor):
        """Forward hooks adding DeepStack feature ``k`` after decoder layer ``k`` at the image tokens."""
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
                labels: Optional[torch.Tensor] = None):
        # mcore's TP gather of the logits allocates on torch.cuda.current_device(): the host's here.
        with host_placement(input_ids.device):
            return self._forward(rows, input_ids, imgs_sizes, labels)

    def _forward(self, rows, input_ids, imgs_sizes, labels):
        grids = [(h // self.patch_dim, w // self.patch_dim) for h, w in imgs_sizes]
        positions = mrope_position_ids(input_ids, self.image_token_id, grids, self.merge)
        image = input_ids == self.image_token_id
        decoder_input, handles = None, []
        if self.pre_process:
            ids = input_ids.masked_fill(image, 0)
            flat = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            embedded = self.language_model.embedding(input_ids=ids, position_ids=flat)  # [s, b, h]
            batch_major = embedded.transpose(0, 1).clone()
            if rows is not None:
                merged, deep = self.image_features(rows, imgs_sizes)
                if int(image.sum()) != merged.shape[0]:
                    raise ValueError(f"{int(image.sum())} image tokens in the ids for {merged.shape[0]} "
                                     f"image embeddings")
                batch_major[image] = merged.to(batch_major.dtype)
                handles = self._inject(deep, image)
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


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Qwen3VLModel:
    text, vc = cfg.text_config, cfg.vision_config
    vision, language_model = build_stage(cfg, text, functools.partial(build_language_model, text, params_dtype),
                                         tower=lambda: tower.build_native(vc, params_dtype))
    model = Qwen3VLModel(vision, language_model, image_token_id=cfg.image_token_id,
                         vocab_size=text.vocab_size, merge=vc.spatial_merge_size,
                         patch_dim=int(vc.patch_size))
    return model.to(params_dtype)
