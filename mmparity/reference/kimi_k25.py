"""Reference side of Kimi-K2.5: transformers' ``Kimi_K25VisionModel`` (+ ``Kimi_K25MultimodalProjection``).

A whole ``Kimi_K25Config`` gives the vision tower and the projector (as ``vision_tower.*`` and
``mm_projector.*``, the names inside ``Kimi_K25Model``); a ``Kimi_K25VisionConfig`` gives the tower
alone. The language model is never built.

HF takes pre-patchified ``(ΣN, 3, P, P)`` pixels with ``grid_thw``; clips are frame-major.
"""

from __future__ import annotations

import torch
from transformers import Kimi_K25Config, Kimi_K25VisionConfig
from transformers.models.kimi_k25.modeling_kimi_k25 import (Kimi_K25MultimodalProjection,
                                                            Kimi_K25VisionModel,
                                                            apply_rotary_pos_emb_vision)

from mmparity.converters.kimi_k25 import has_projector, vision_cfg
from mmparity.parity import inputs
from mmparity.parity.cases import Case, Pair, tokens_2d

MODEL_TYPES = ("kimi_k25", "kimi_k25_vision")
CHANNELS = 3  # HF's patch Conv2d has a literal 3 input channels


def tiny_config() -> Kimi_K25Config:
    """Awkward tiny sizes: 4 heads of 12 (TP 1/2/4; hd % 4 == 0 for 2D RoPE), FFN 44 (not a multiple
    of 48), patch 5, a 6x6 position table (so most grids resample), 4 temporal rows, text hidden 40.
    """
    vision = Kimi_K25VisionConfig(patch_size=5, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4,
                                  num_attention_heads=4, num_hidden_layers=2, hidden_size=48,
                                  intermediate_size=44)
    text = {"model_type": "deepseek_v3", "hidden_size": 40, "num_hidden_layers": 1, "vocab_size": 64,
            "intermediate_size": 32, "moe_intermediate_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 2, "first_k_dense_replace": 1, "q_lora_rank": None,
            "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
            "n_routed_experts": 2, "num_experts_per_tok": 1}
    return Kimi_K25Config(vision_config=vision, text_config=text, projection_hidden_size=48,
                          tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole Kimi-K2.5 config (tower + projector) or a vision config (tower)."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a Kimi-K2.5 model")


class KimiK25VisionReference(torch.nn.Module):
    """The vision half of ``Kimi_K25Model``: tower and projector under their HF attribute names."""

    def __init__(self, cfg: Kimi_K25Config):
        super().__init__()
        self.config = cfg
        self.vision_tower = Kimi_K25VisionModel(cfg.vision_config)
        self.mm_projector = Kimi_K25MultimodalProjection(cfg)

    def forward(self, pixel_values, grid_thw):
        out = self.vision_tower(pixel_values, grid_thw=grid_thw)
        return out, self.mm_projector(out.pooler_output).squeeze(1)


def build(cfg):
    model = KimiK25VisionReference(cfg) if has_projector(cfg) else Kimi_K25VisionModel(cfg)
    return model.float().eval()


def _tower(model):
    return model.vision_tower if isinstance(model, KimiK25VisionReference) else model


def patch_size(cfg) -> int:
    p = vision_cfg(cfg).patch_size
    return p if isinstance(p, int) else p[0]


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


def _pixel_values(case: Case, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    frames = [f for item in case.data["images"] for f in (item if item.dim() == 4 else item.unsqueeze(0))]
    rows = inputs.packed_rows(frames, p)[0]
    grid_thw = torch.tensor([[t, h // p, w // p]
                             for (h, w), t in zip(case.data["sizes"], case.data["frames"])])
    return rows.view(rows.shape[0], CHANNELS, p, p), grid_thw


def run(model, case: Case) -> dict:
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    if case.name == "projector":
        vc = model.config.vision_config
        features = case.data["features"].view(-1, 4, vc.hidden_size).to(device, dtype)
        return {"image_embeds": model.mm_projector(features).squeeze(1)}
    tower = _tower(model)
    pixels, grid_thw = _pixel_values(case, case.data["patch"])
    out = tower(pixels.to(device, dtype), grid_thw=grid_thw.to(device))
    result = {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output.flatten(1)}
    if isinstance(model, KimiK25VisionReference):
        result["image_embeds"] = model.mm_projector(out.pooler_output).squeeze(1)
    return {k: v for k, v in result.items() if k in case.outputs}


def prepare_case(case: Case, cfg) -> Case:
    case.data.setdefault("patch", patch_size(cfg))
    return case


def _conv_tokens(output, case: Case):
    return output.flatten(1)  # (ΣN, H, 1, 1) -> (ΣN, H)


def pairs(model, cfg) -> list[Pair]:
    tower = _tower(model)
    out = [Pair("patch_embed", tower.patch_embed.proj, _conv_tokens),
           Pair("pos_embed", tower.patch_embed.pos_emb, tokens_2d)]
    out += [Pair(f"layer.{i}", layer, tokens_2d) for i, layer in enumerate(tower.layers)]
    out.append(Pair("final_layernorm", tower.final_layernorm, tokens_2d))
    if isinstance(model, KimiK25VisionReference):
        out.append(Pair("projector", model.mm_projector, tokens_2d))
    return out


COMPONENTS = ("patch_embed", "pos_embed", "rope2d", "merger")


def rope_reference(model, cfg, seed: int, grid: tuple[int, int]) -> torch.Tensor:
    """HF's rotary embedding on seeded q in the model's dtype: (N, heads, hd), rotate-half layout."""
    vc = vision_cfg(cfg)
    heads = vc.num_attention_heads
    q = inputs.rope_probe(heads, vc.hidden_size // heads, grid, seed)
    q = inputs.like_model(q, model)
    h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h, device=q.device), torch.arange(w, device=q.device),
                                indexing="ij")
    position_ids = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    cos, sin = _tower(model).rotary_emb(q, position_ids)
    rotated, _ = apply_rotary_pos_emb_vision(q.unsqueeze(0), q.unsqueeze(0), cos, sin)
    return rotated[0]


def component(name: str, model, cfg, seed: int) -> torch.Tensor:
    vc = vision_cfg(cfg)
    tower = _tower(model)
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
