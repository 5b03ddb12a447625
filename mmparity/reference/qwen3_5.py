"""Reference side of Qwen3.5-MoE VL: transformers' ``Qwen3_5MoeVisionModel``.

HF takes pre-patchified rows in the image processor's layout (block-first, width C·T·P·P) plus
``grid_thw``. Its ``last_hidden_state`` is the stack output *before* the merger; the native tower's
output is after the merger's norm and 2×2 grouping, so :func:`run` applies HF's own merger norm and
grouping to compare like with like. ``pooler_output`` is HF's whole merger.
"""

from __future__ import annotations

import torch
from transformers import Qwen3_5MoeVisionConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (Qwen3_5MoeVisionModel,
                                                                    apply_rotary_pos_emb_vision)
from transformers.vision_utils import (get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids)

from mmparity.parity import inputs
from mmparity.parity.cases import Case, Pair, tokens_2d

MODEL_TYPES = ("qwen3_5_moe_vision",)
# Whole-VLM configs that carry this tower as ``vision_config``.
PARENT_MODEL_TYPES = ("qwen3_5_moe",)
OUTPUTS = ("last_hidden_state", "pooler_output")


def tiny_config() -> Qwen3_5MoeVisionConfig:
    """Awkward tiny sizes: 4 heads of 12 (TP 2 and 4; hd % 4 == 0 for 2D RoPE), FFN 44 not a
    multiple of hidden 48, odd patch size 5, out size 36, and a 5×5 learned position table so that
    grids beyond the table are cheap."""
    return Qwen3_5MoeVisionConfig(depth=2, hidden_size=48, intermediate_size=44, num_heads=4,
                                  in_channels=3, patch_size=5, temporal_patch_size=2,
                                  spatial_merge_size=2, out_hidden_size=36,
                                  num_position_embeddings=25, hidden_act="gelu_pytorch_tanh")


def vision_config(cfg):
    """The vision config inside ``cfg`` (itself, or a ``Qwen3_5MoeConfig``'s ``vision_config``)."""
    model_type = getattr(cfg, "model_type", None)
    if model_type in MODEL_TYPES:
        return cfg
    sub = getattr(cfg, "vision_config", None)
    if model_type in PARENT_MODEL_TYPES and getattr(sub, "model_type", None) in MODEL_TYPES:
        return sub
    raise ValueError(f"config of model_type {model_type!r} is not a Qwen3.5-MoE vision model "
                     f"(expected one of {MODEL_TYPES + PARENT_MODEL_TYPES})")


def build(cfg) -> Qwen3_5MoeVisionModel:
    return Qwen3_5MoeVisionModel(cfg).eval()


def _int(value) -> int:
    return value if isinstance(value, int) else int(value[0])


def table_side(cfg) -> int:
    return int(cfg.num_position_embeddings ** 0.5)


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Three sizes (pixels) for one packed pass: a grid inside the learned table, one beyond it on
    both axes, and a tall one that crosses it on one axis only; none square."""
    p, m, g = _int(cfg.patch_size), cfg.spatial_merge_size, table_side(cfg)
    beyond = (g // m + 1) * m
    grids = [(m, 2 * m), (beyond + m, beyond + 2 * m), (beyond, m)]
    return [(h * p, w * p) for h, w in grids]


def _check_sizes(sizes, cfg) -> None:
    step = _int(cfg.patch_size) * cfg.spatial_merge_size
    bad = [s for s in sizes if s[0] % step or s[1] % step or min(s) <= 0]
    if bad:
        raise ValueError(f"image sizes {bad} are not positive multiples of patch_size*"
                         f"spatial_merge_size = {step}")


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    """Static pixels, packed single-frame rows, packed HF-processor rows (T distinct frames)."""
    p, m = _int(cfg.patch_size), cfg.spatial_merge_size
    sizes = [tuple(s) for s in (image_sizes or default_image_sizes(cfg))]
    _check_sizes(sizes, cfg)
    common = {"patch": p, "merge": m}

    def grids(ss):
        return ", ".join(f"{h // p}x{w // p}" for h, w in ss)

    # A static batch shares one size: a non-square one, distinct from the packed sizes by default.
    static_sizes = [sizes[0]] * 2 if image_sizes else [(3 * m * p, 2 * m * p)] * 2
    static = {"layout": "pixels", "images": inputs.images(static_sizes, cfg.in_channels, seed + 1),
              "sizes": static_sizes, **common}
    packed = {"layout": "frame_rows", "images": inputs.images(sizes, cfg.in_channels, seed),
              "sizes": sizes, **common}
    t = _int(cfg.temporal_patch_size)
    # T different frames per image: exercises the whole Conv3d kernel, not only its sum over T.
    frames = inputs.images([s for s in sizes for _ in range(t)], cfg.in_channels, seed + 2)
    clips = [torch.stack(frames[i * t:(i + 1) * t]) for i in range(len(sizes))]
    tubelets = {"layout": "processor_rows", "clips": clips, "sizes": sizes, **common}
    g = table_side(cfg)
    return [
        Case("static", static, OUTPUTS, f"static batch of 2 images, grid {grids(static_sizes[:1])}"),
        Case("packed", packed, OUTPUTS, f"{len(sizes)} images (grids {grids(sizes)}; table {g}x{g}) "
                                        f"as C*P*P rows in one packed pass"),
        Case("processor_rows", tubelets, OUTPUTS, f"{len(sizes)} {t}-frame tubelets (grids "
                                                  f"{grids(sizes)}) as HF processor rows (C*T*P*P) "
                                                  f"in one packed pass"),
    ]


def processor_rows(case: Case, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The case as HF consumes it: (ΣN, C·T·P·P) rows and ``grid_thw`` (n, 3)."""
    p, m, t = _int(cfg.patch_size), cfg.spatial_merge_size, _int(cfg.temporal_patch_size)
    if case.data["layout"] == "processor_rows":
        clips = case.data["clips"]
    else:
        # A still image in the processor's layout is its frame repeated T times.
        clips = [img.unsqueeze(0).expand(t, -1, -1, -1) for img in case.data["images"]]
    rows = torch.cat([inputs.block_first_patch_rows(c, p, m) for c in clips])
    grid_thw = torch.tensor([[1, h // p, w // p] for h, w in case.data["sizes"]])
    return rows, grid_thw


def run(model, case: Case) -> dict:
    cfg = model.config
    param = next(model.parameters())
    rows, grid_thw = processor_rows(case, cfg)
    out = model(rows.to(param.device, param.dtype), grid_thw=grid_thw.to(param.device))
    merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
    # HF's last_hidden_state precedes the merger; through HF's merger norm and 2×2 grouping it is
    # the native tower's output (rows are block-first, so grouping is a plain view).
    tokens = model.merger.norm(out.last_hidden_state).reshape(-1, merged)
    pooled = out.pooler_output.reshape(-1, cfg.out_hidden_size)
    return {"last_hidden_state": tokens, "pooler_output": pooled}


def pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.patch_embed, tokens_2d)]
    out += [Pair(f"layer.{i}", block, tokens_2d) for i, block in enumerate(model.blocks)]
    out += [Pair("merger.norm", model.merger.norm, tokens_2d),
            Pair("merger.linear_fc1", model.merger.linear_fc1, tokens_2d),
            Pair("merger.linear_fc2", model.merger.linear_fc2, tokens_2d)]
    return out


COMPONENTS = ("patch_embed", "pos_embed", "rope2d", "block_first", "merger")


def _grid_thw(grids) -> torch.Tensor:
    return torch.tensor([[1, h, w] for h, w in grids])


@torch.no_grad()
def component(name: str, model, cfg, seed: int) -> torch.Tensor:
    param = next(model.parameters())
    m = cfg.spatial_merge_size
    grids = inputs.grids_around_table(table_side(cfg), m)
    grid_thw = _grid_thw(grids)
    if name == "patch_embed":
        h, w = grids[-1]
        p, t = _int(cfg.patch_size), _int(cfg.temporal_patch_size)
        img = inputs.images([(h * p, w * p)], cfg.in_channels, seed)[0]
        rows = inputs.block_first_patch_rows(img.unsqueeze(0).expand(t, -1, -1, -1), p, m)
        return model.patch_embed(rows.to(param.device, param.dtype))
    if name == "pos_embed":
        # HF's forward computes this inline; same helper, same arguments.
        index, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=model.num_grid_per_side, mode=model.interpolation_mode,
            align_corners=model.interpolation_align_corners, spatial_merge_size=m)
        return (model.pos_embed(index.to(param.device)) * weights.to(param.device)[:, :, None]).sum(1)
    if name == "rope2d":
        position_ids = get_vision_position_ids(grid_thw, m)
        heads = cfg.num_attention_heads
        q = inputs.rope_probe(heads, cfg.hidden_size // heads, (position_ids.shape[0], 1), seed)
        q = q.to(param.device, param.dtype)
        cos, sin = model.rotary_pos_emb(q, position_ids.to(param.device))
        rotated, _ = apply_rotary_pos_emb_vision(q, q, cos, sin)
        return rotated
    if name == "block_first":
        return get_vision_position_ids(grid_thw, m).float()
    if name == "merger":
        x = inputs.token_probe(sum(h * w for h, w in grids), cfg.hidden_size, seed)
        return model.merger(x.to(param.device, param.dtype))
    raise KeyError(name)
