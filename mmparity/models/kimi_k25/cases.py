"""Kimi-K2.5 parity: static, packed, video-clip and projector cases, each side's paired modules and
components, and the family's hook record.

HF takes pre-patchified ``(ΣN, 3, P, P)`` pixels with ``grid_thw``; clips are frame-major.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as mcore_apply_rope
from transformers import Kimi_K25Config, Kimi_K25VisionConfig

from mmparity.models.core import sublayers
from mmparity.models.core import inputs
from mmparity.models.core import megatron_side
from mmparity.models.spec import (
    Bench, Case, FamilyHooks, Pair, Parity, Published, Side, TowerShape, module_hooks, recording_patch,
    sbh_tokens_2d, tokens_2d)
from mmparity.models.kimi_k25 import mapping as converter
from mmparity.models.kimi_k25 import megatron as kimi_megatron
from mmparity.mapping.ops import RopeInterleave
from mmparity.config import has_vision_sub_config as has_projector
from mmparity.config import head_dim
from mmparity.config import vision_sub_config as vision_cfg
from mmparity.models.kimi_k25 import native
from mmparity.models.core.layers import numbered_layers
from mmparity.models.kimi_k25.native import KimiViTWithProjector, tower
from mmparity.models.kimi_k25 import reference
from mmparity.models.kimi_k25.reference import CHANNELS, KimiK25VisionReference, patch_size, vision_tower

COMPONENTS = ("patch_embed", "pos_embed", "rope2d", "merger")


def image_size_multiple(cfg) -> int:
    """Image sides must be multiples of patch size x merge size (the 2x2 merger tiles the grid)."""
    return patch_size(cfg) * tuple(vision_cfg(cfg).merge_kernel_size)[0]


def default_grids(cfg) -> dict:
    vc = vision_cfg(cfg)
    table = (vc.pos_emb_height, vc.pos_emb_width)
    return {
        # Both sides differ from the table: rows shrink, columns grow (bicubic both ways).
        "static": (4, 10),
        # The table's own grid (identity path) among resampled ones; merged grids 3x3, 5x2, 3x4.
        "packed": [table, (10, 4), (6, 8)],
        # A clip and a still image in one packed pass.
        "video": [(4, 6), (8, 2)],
    }


def _clip(size, frames: int, seed: int) -> torch.Tensor:
    return torch.stack(inputs.images([size] * frames, CHANNELS, seed))


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    vc = vision_cfg(cfg)
    p = patch_size(cfg)
    grids = default_grids(cfg)
    outputs = ("pooler_output", "last_hidden_state") + (("image_embeds",) if has_projector(cfg) else ())
    if image_sizes:
        packed_sizes = [tuple(s) for s in image_sizes]
        static_size, video_sizes = packed_sizes[0], packed_sizes[:1] + packed_sizes[1:2]
    else:
        packed_sizes = [(h * p, w * p) for h, w in grids["packed"]]
        static_size = (grids["static"][0] * p, grids["static"][1] * p)
        video_sizes = [(h * p, w * p) for h, w in grids["video"]]
    frames = min(3, vc.pos_emb_time)
    described = lambda sizes: ", ".join(f"{h}x{w}" for h, w in sizes)  # noqa: E731

    out = [
        Case("static", {"images": inputs.images([static_size] * 2, CHANNELS, seed + 1),
                        "sizes": [static_size] * 2, "frames": [1, 1], "static": True},
             outputs=outputs, description=f"static batch of 2 images {described([static_size])}"),
        Case("packed", {"images": inputs.images(packed_sizes, CHANNELS, seed),
                        "sizes": packed_sizes, "frames": [1] * len(packed_sizes)},
             outputs=outputs,
             description=f"{len(packed_sizes)} images {described(packed_sizes)} in one packed pass"),
    ]
    if frames > 1:
        items = [_clip(video_sizes[0], frames, seed + 2)]
        items += inputs.images(video_sizes[1:], CHANNELS, seed + 3)
        extra = f" and image {described(video_sizes[1:])}" if len(video_sizes) > 1 else ""
        out.append(Case("video", {"images": items, "sizes": video_sizes,
                                  "frames": [frames] + [1] * (len(video_sizes) - 1)},
                        outputs=outputs,
                        description=f"a {frames}-frame clip {described(video_sizes[:1])}{extra}"))
    if has_projector(cfg):
        merged = 4 * vc.hidden_size
        features = torch.randn(7, merged, generator=inputs.generator(seed + 4))
        out.append(Case("projector", {"features": features}, outputs=("image_embeds",),
                        description=f"projector alone on 7 merged tokens of width {merged}"))
    return out


prepare_case = recording_patch(patch_size)


# --- the reference side (transformers) -----------------------------------------------------------


def _pixel_values(case: Case, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    frames = [f for item in case.data["images"] for f in (item if item.dim() == 4 else item.unsqueeze(0))]
    rows = inputs.packed_rows(frames, p)[0]
    grid_thw = torch.tensor([[t, h // p, w // p]
                             for (h, w), t in zip(case.data["sizes"], case.data["frames"])])
    return rows.view(rows.shape[0], CHANNELS, p, p), grid_thw


def reference_run(model, case: Case) -> dict:
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    if case.name == "projector":
        vc = model.config.vision_config
        features = case.data["features"].view(-1, 4, vc.hidden_size).to(device, dtype)
        return {"image_embeds": model.mm_projector(features).squeeze(1)}
    tower = vision_tower(model)
    pixels, grid_thw = _pixel_values(case, case.data["patch"])
    out = tower(pixels.to(device, dtype), grid_thw=grid_thw.to(device))
    result = {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output.flatten(1)}
    if isinstance(model, KimiK25VisionReference):
        result["image_embeds"] = model.mm_projector(out.pooler_output).squeeze(1)
    return {k: v for k, v in result.items() if k in case.outputs}


def _conv_tokens(output, case: Case):
    return output.flatten(1)  # (ΣN, H, 1, 1) -> (ΣN, H)


def reference_pairs(model, cfg) -> list[Pair]:
    tower = vision_tower(model)
    out = [Pair("patch_embed", tower.patch_embed.proj, _conv_tokens),
           Pair("pos_embed", tower.patch_embed.pos_emb, tokens_2d)]
    for i, layer in enumerate(tower.layers):
        out += sublayers.layer_pairs(f"layer.{i}", layer, tokens_2d, sublayers.HF_VISION_BLOCK)
    out.append(Pair("final_layernorm", tower.final_layernorm, tokens_2d))
    if isinstance(model, KimiK25VisionReference):
        out.append(Pair("projector", model.mm_projector, tokens_2d))
    return out


def rope_reference(model, cfg, seed: int, grid: tuple[int, int]) -> torch.Tensor:
    """HF's rotary embedding on seeded q in the model's dtype: (N, heads, hd), rotate-half layout."""
    # Model code, imported where it runs: loading the hooks (to write torch_dist) does not pay for it.
    from transformers.models.kimi_k25.modeling_kimi_k25 import apply_rotary_pos_emb_vision

    vc = vision_cfg(cfg)
    heads = vc.num_attention_heads
    q = inputs.rope_probe(heads, head_dim(vc), grid, seed)
    q = inputs.like_model(q, model)
    h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h, device=q.device), torch.arange(w, device=q.device),
                                indexing="ij")
    position_ids = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    cos, sin = vision_tower(model).rotary_emb(q, position_ids)
    rotated, _ = apply_rotary_pos_emb_vision(q.unsqueeze(0), q.unsqueeze(0), cos, sin)
    return rotated[0]


def reference_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    vc = vision_cfg(cfg)
    tower = vision_tower(model)
    param = next(model.parameters())
    p = patch_size(cfg)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(p)], CHANNELS, seed)[0]
        rows = inputs.patchify(img, p).view(-1, CHANNELS, p, p)
        return tower.patch_embed.proj(rows.to(param.device, param.dtype)).flatten(1)
    if name == "pos_embed":
        grids_thw = inputs.component_grids_thw((vc.pos_emb_height, vc.pos_emb_width), vc.pos_emb_time)
        grid_thw = torch.tensor(grids_thw, device=param.device)
        total = sum(t * h * w for t, h, w in grids_thw)
        zeros = torch.zeros(total, vc.hidden_size, dtype=param.dtype, device=param.device)
        return tower.patch_embed.pos_emb(zeros, grid_thw)
    if name == "rope2d":
        return rope_reference(model, cfg, seed, inputs.COMPONENT_GRID)
    if name == "merger":
        grid_thw = torch.tensor(inputs.MERGER_GRIDS_THW, device=param.device)
        hidden = inputs.token_probe(int(grid_thw.prod(-1).sum()), vc.hidden_size, seed)
        kh, kw = tuple(vc.merge_kernel_size)
        return tower.temporal_merge(hidden.to(param.device, param.dtype), grid_thw, kh, kw).flatten(1)
    raise KeyError(name)


REFERENCE = Side(reference_run, reference_pairs, reference_component)


# --- the native side (mcore) ---------------------------------------------------------------------


def _rows(items: Sequence[torch.Tensor], patch: int) -> torch.Tensor:
    """Images (C, H, W) and clips (T, C, H, W) -> packed rows (1, ΣN, C·P·P), frames in order."""
    frames = [f for item in items for f in (item if item.dim() == 4 else item.unsqueeze(0))]
    return inputs.packed_rows(frames, patch)


def native_run(model, case) -> dict:
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    if case.name == "projector":
        if not model.post_process:
            return {}  # the projector lives on the last pipeline stage
        return {"image_embeds": model.vision_projection(case.data["features"].to(device, dtype))}
    items = case.data["images"]
    if case.data.get("static"):
        out = model.encode(torch.stack(items).to(device, dtype))
    else:
        rows = _rows(items, model.patch_dim).to(device, dtype)
        out = model.encode(rows, imgs_sizes=case.data["sizes"], num_frames=case.data["frames"])
    if not model.post_process:
        return {}  # an earlier pipeline stage: the last one holds the outputs
    hidden = out.last_hidden_state
    result = {"last_hidden_state": hidden.reshape(-1, hidden.shape[-1]),
              "pooler_output": out.pooler_output.reshape(-1, out.pooler_output.shape[-1])}
    if out.image_embeds is not None:
        result["image_embeds"] = out.image_embeds.reshape(-1, out.image_embeds.shape[-1])
    return {k: v for k, v in result.items() if k in case.outputs}


def native_pairs(model, cfg) -> list:
    vit = tower(model)
    out = [Pair("patch_embed", getattr(vit.patch_embed, "proj", None), tokens_2d),
           Pair("pos_embed", vit.pos_embed, tokens_2d)]
    for i, layer in numbered_layers(vit.decoder):
        out += sublayers.layer_pairs(f"layer.{i}", layer, sbh_tokens_2d)
    out.append(Pair("final_layernorm", vit.final_ln, sbh_tokens_2d))
    if isinstance(model, KimiViTWithProjector):
        out.append(Pair("projector", model.vision_projection, tokens_2d))
    return out


def apply_mcore_rope(model, q: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """mcore's own RoPE application on (N, heads, hd) activations in its interleaved layout."""
    return mcore_apply_rope(q.unsqueeze(1), freqs, model.config).squeeze(1)


def native_component(name: str, model, cfg, seed: int) -> torch.Tensor:
    vc = vision_cfg(cfg)
    param = next(model.parameters())
    model = tower(model)
    if name == "patch_embed":
        img = inputs.images([inputs.component_image_size(model.patch_dim)], 3, seed)[0]
        tokens, _, _ = model.patch_embed.proj(img.unsqueeze(0).to(param.device, param.dtype))
        return tokens[0]
    if name == "pos_embed":
        grids, frames = _split_thw(inputs.component_grids_thw((vc.pos_emb_height, vc.pos_emb_width),
                                                              vc.pos_emb_time))
        total = sum(t * h * w for (h, w), t in zip(grids, frames))
        zeros = torch.zeros(1, total, vc.hidden_size, dtype=param.dtype, device=param.device)
        return model.pos_embed(zeros, grids, frames)[0]
    if name == "rope2d":
        heads, hd = vc.num_attention_heads, head_dim(vc)
        q = inputs.rope_probe(heads, hd, inputs.COMPONENT_GRID, seed)
        n = q.shape[0]
        # HF rows are rotate-half permuted per head; the converter undoes that on q/k weights,
        # here the same permutation is applied to activations.
        op = RopeInterleave(heads, hd)
        q_mcore = op.apply([q.reshape(n, heads * hd).T])[0].T.reshape(n, heads, hd)
        freqs = model.rotary_pos_emb.for_grid(*inputs.COMPONENT_GRID, 1, param.device)
        rotated = apply_mcore_rope(model, q_mcore.to(freqs.device, param.dtype), freqs)
        return op.invert([rotated.reshape(n, heads * hd).T])[0].T.reshape(n, heads, hd)
    if name == "merger":
        grids, frames = _split_thw(inputs.MERGER_GRIDS_THW)
        hidden = inputs.token_probe(sum(t * h * w for (h, w), t in zip(grids, frames)), vc.hidden_size, seed)
        return model.merger.merge_packed(hidden.unsqueeze(0).to(param.device, param.dtype), grids, frames)[0]
    raise KeyError(name)


def _split_thw(grids_thw) -> tuple[list, list]:
    return [(h, w) for _, h, w in grids_thw], [t for t, _, _ in grids_thw]


NATIVE = Side(native_run, native_pairs, native_component)


# --- the registry's record -------------------------------------------------------------------------

def _text_config(hidden: int) -> dict:
    return {"model_type": "deepseek_v3", "hidden_size": hidden, "num_hidden_layers": 1,
            "vocab_size": 32, "intermediate_size": 16, "moe_intermediate_size": 8,
            "num_attention_heads": 2, "num_key_value_heads": 2, "first_k_dense_replace": 1,
            "q_lora_rank": None, "kv_lora_rank": 4, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
            "v_head_dim": 4, "n_routed_experts": 2, "num_experts_per_tok": 1}


def random_config(pick):
    """Random tower shapes; a whole config (with projector) or a vision config."""
    heads = pick([1, 2, 4, 6])
    hidden = heads * pick([4, 8, 12])
    table = pick(range(2, 6))
    vision = Kimi_K25VisionConfig(
        patch_size=pick([2, 3]), pos_emb_height=table, pos_emb_width=table,
        pos_emb_time=pick(range(1, 5)), num_attention_heads=heads,
        num_hidden_layers=pick(range(1, 3)), hidden_size=hidden,
        intermediate_size=pick(range(1, 7)) * 4)
    if pick([False, True]):
        return vision
    return Kimi_K25Config(vision_config=vision, text_config=_text_config(pick([8, 20])),
                          projection_hidden_size=hidden, tie_word_embeddings=False)


PUBLISHED = Published(
    source="Kimi-K2.5 MoonViT 27x1152 + projector to the DeepSeek-V3 text width 7168",
    vision=dict(patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4,
                num_attention_heads=16, num_hidden_layers=27, hidden_size=1152,
                intermediate_size=4304, hidden_act="gelu_pytorch_tanh", merge_kernel_size=(2, 2)),
    parent={"projection_hidden_size": 1152, "text_config.hidden_size": 7168},
    images=8, image_size=(896, 896),
    # 31744 tokens (uniform: 32768); multiples of patch 14 x merge 2.
    mixed=((896, 896), (672, 1120), (1120, 672), (784, 784), (1008, 1008), (560, 1120),
           (1120, 1120), (448, 896)))


def flop_shape(cfg, base: TowerShape) -> TowerShape:
    mh, mw = vision_cfg(cfg).merge_kernel_size
    if mh != mw:
        raise NotImplementedError("non-square merge kernels are not counted")
    base = replace(base, merge=mh, channels=3)
    if getattr(cfg, "text_config", None) is None:
        return base  # tower only: 2x2 grouping has no FLOPs
    wide = base.hidden * mh * mw
    return replace(base, merger=((wide, wide), (wide, cfg.text_config.hidden_size)))


# --- Megatron's own class: Megatron-LM main's KimiViTModel (+ the closest projector) ---------------

def megatron_cases(hooks: FamilyHooks, cfg, seed: int, image_sizes) -> list[Case]:
    """Every case but the clip: ``KimiViTModel`` has no temporal axis."""
    return [c for c in hooks.parity.cases(cfg, seed, image_sizes) if c.name != "video"]


def megatron_run(model, case: Case, cfg) -> dict:
    tower, projection = kimi_megatron.kimi_parts(model)
    if case.name == "projector":
        return {"image_embeds": projection(case.data["features"])}
    seen = {}
    handle = tower.final_ln.register_forward_hook(lambda module, args, out: seen.setdefault("x", out))
    try:
        merged, projected = kimi_megatron.run_kimi(model, case.data["images"])
    finally:
        handle.remove()
    out = {"pooler_output": merged, "last_hidden_state": seen["x"].reshape(-1, merged.shape[-1] // 4)}
    if projected is not None:
        out["image_embeds"] = projected
    return out


def megatron_pairs(model, cfg) -> list[Pair]:
    tower, projection = kimi_megatron.kimi_parts(model)
    out = [Pair("patch_embed", tower.patch_embed, tokens_2d)] + megatron_side.layer_pairs(tower)
    out.append(Pair("final_layernorm", tower.final_ln, tokens_2d))
    if projection is not None:
        out.append(Pair("projector", projection, tokens_2d))
    return out


# What Megatron's default class has no place for, kept beside its state dict (the side file), on
# the config its layout is measured on: tests/models/test_upstream.py holds the converter to it.
# The projector norm is written in Megatron's fused-norm place, tiled (exactly invertible).
SIDE_TENSORS = frozenset()
MEGATRON = {"KimiViTModel+MultimodalProjector": megatron_side.MegatronClass(
    kimi_megatron.build_kimi_k25, megatron_cases, megatron_run, megatron_pairs)}


def hooks(towers) -> FamilyHooks:
    return module_hooks(reference, native, converter.SPEC, reference=REFERENCE, native=NATIVE,
                        random_config=random_config, image_size_multiple=image_size_multiple,
                        parity=Parity(cases, prepare_case, COMPONENTS), megatron=MEGATRON,
                        bench=Bench(flop_shape, PUBLISHED))
