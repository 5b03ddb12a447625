"""The shared pieces of Megatron's own classes, built from HF configs, and their forward.

The HF config is the only source of shapes and hyper-parameters (read duck-typed through
:mod:`mmparity.config`: this layer never imports transformers). A family's own builder lives in
its package's ``megatron.py`` and is configured by its one recipe (its ``config.py``); which family
loads into which class is said by the family itself (its hooks' ``megatron`` record), not here.
This module knows no family: it holds what those builders share.

========================  =====================================================================
piece                     what it is
========================  =====================================================================
transformer_config        a family's recipe as Megatron's classes take it (inference at the
                          current TP size, fusions off)
stock_clip_vit            stock ``CLIPViTModel`` on a tower config's geometry
vit_model                 Megatron-LM main's ``ViTModel`` on a tower config's geometry
projection_config         a projector recipe as ``MultimodalProjector`` takes it
VisionWithProjection      a tower and its projector under ``LLaVAModel``'s names, for the parts
                          of a VLM whose ``vit_model`` tower Megatron-LM's ``LLaVAModel`` cannot
                          hold (docs/megatron.md, discrepancy 5)
========================  =====================================================================

A builder that needs Megatron-LM main's ``vit_model.py`` is marked :func:`needs_vit_model`, so that
:func:`require` / :func:`available` say so before anything is built.

All builders use the parallel state already initialised (``mmparity.parallel.runtime``); TE modules are
the real ones when Transformer Engine is importable, else the stand-ins of
:mod:`mmparity.models.core.te_stand_ins`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from megatron.core import activations as mcore_activations
from megatron.core import package_info
from megatron.core.models.vision import clip_vit_model
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.parallel import runtime
from mmparity.config import first_int, image_hw
from mmparity.models.core.layers import activation_from_hf, vision_transformer_config
from mmparity.models.core import te_stand_ins
from mmparity.models.core.te_stand_ins import buildable_without_te, te_class

VIT_MODEL_MODULE = "megatron.core.models.vision.vit_model"
INSTALL_HINT = ("Megatron-LM main's megatron/core/models/vision/vit_model.py is needed: put a "
                "Megatron-LM checkout (github.com/NVIDIA/Megatron-LM, main) first on PYTHONPATH and "
                "`pip install triton` (it is only imported)")


class UpstreamUnavailable(ImportError):
    """Megatron's class for a family cannot be imported here; the message says what to install."""


def vit_model_module():
    """Megatron-LM main's ``vit_model`` module, or :class:`UpstreamUnavailable`."""
    try:
        return importlib.import_module(VIT_MODEL_MODULE)
    except ImportError as exc:
        raise UpstreamUnavailable(f"{INSTALL_HINT} (import failed: {exc})") from None


def needs_vit_model(builder: Callable) -> Callable:
    """Marks a builder whose class lives in Megatron-LM main's ``vit_model.py``."""
    builder.needs_vit_model = True
    return builder


def require(builder: Optional[Callable] = None) -> None:
    """Raise :class:`UpstreamUnavailable` (naming what to install) unless ``builder``'s class can be
    imported here (None: unless Megatron-LM main's ``vit_model`` can)."""
    if builder is None or getattr(builder, "needs_vit_model", False):
        vit_model_module()


def available(builder: Optional[Callable] = None) -> bool:
    """Whether ``builder``'s class can be imported here (None: Megatron-LM main's ``vit_model``)."""
    try:
        require(builder)
    except UpstreamUnavailable:
        return False
    return True


# --- HF config reading, and the TransformerConfig recipe the native models use --------------------

def activation(name: str) -> Callable:
    """The HF activation as a Megatron-LM user configures it: mcore's own ``quick_gelu`` (CLIP),
    otherwise the exact function the native models take."""
    return mcore_activations.quick_gelu if name == "quick_gelu" else activation_from_hf(name)


def transformer_config(*, pipelined: bool = False, **fields) -> TransformerConfig:
    """``native.core.layers.vision_transformer_config``: inference at the current TP size, fusions
    off (they need CUDA). Only a ``pipelined`` stack (LLaVA's language model) is split over the
    pipeline stages; Megatron-LM builds towers and projectors whole, on the first stage."""
    if not pipelined:
        fields["pipeline_model_parallel_size"] = 1
    return vision_transformer_config(pipelined_stack=pipelined, **fields)


def projection_config(params_dtype=torch.float32, **fields) -> TransformerConfig:
    """``MultimodalProjector``'s config from a projector recipe's fields (``hidden_size`` its
    output width, ``ffn_hidden_size`` its inner width, ``activation`` a function); attention
    fields only have to be valid (one head per TP rank)."""
    layout = runtime.current_layout()
    heads = layout.tp if layout is not None else 1
    return transformer_config(num_layers=1, num_attention_heads=heads, kv_channels=1, params_dtype=params_dtype,
                              **fields)


# --- builders -------------------------------------------------------------------------------------

class VisionWithProjection(torch.nn.Module):
    """A tower and its projector under ``LLaVAModel``'s attribute names, without a language model,
    so that keys read ``vision_model.*`` / ``vision_projection.*`` exactly as in ``LLaVAModel``."""

    def __init__(self, vision_model: torch.nn.Module, vision_projection: Optional[torch.nn.Module]):
        super().__init__()
        self.vision_model = vision_model
        self.vision_projection = vision_projection


def stock_clip_vit(vc, subtype: str, config: TransformerConfig, class_tokens: int):
    """Stock ``CLIPViTModel`` of ``model_subtype`` ``subtype`` on an HF tower config's geometry,
    with ``class_tokens`` class tokens (the CLIP and SigLIP families build theirs with it)."""
    if vc.num_channels != 3:
        raise ValueError(f"stock CLIPViTModel has 3 input channels, the config has {vc.num_channels}")
    img_h, img_w = image_hw(vc)
    with buildable_without_te(clip_vit_model):
        model = clip_vit_model.CLIPViTModel(
            config, te_stand_ins.vit_layer_spec(), ln_pre_impl=te_class("TENorm"),
            ln_post_impl=te_class("TENorm"), add_class_token=class_tokens > 0,
            class_token_len=class_tokens, patch_dim=first_int(vc.patch_size),
            img_h=img_h, img_w=img_w, model_subtype=subtype)
    return model.eval()


def vit_model(vc, config: TransformerConfig, **mode):
    """Megatron-LM main's ``ViTModel`` on an HF tower config's geometry (no patch-embedding bias in
    any of these towers); ``mode`` is the rest of the family's configuration."""
    vit = vit_model_module()
    img_h, img_w = image_hw(vc)
    with buildable_without_te(vit):
        return vit.ViTModel(config, te_stand_ins.vit_layer_spec(), patch_dim=first_int(vc.patch_size),
                            img_h=img_h, img_w=img_w, in_channels=vc.num_channels, patch_embed_bias=False,
                            **mode)


def build(builder: Callable, cfg, params_dtype=torch.float32, *, divisible_by: Optional[int] = None,
          **options):
    """``builder``'s Megatron class from the HF config, in eval mode, at the current TP size
    (TP 1 is initialised when no parallel state exists). ``divisible_by``: Megatron-LM's
    ``--make-vocab-size-divisible-by`` for a class with a vocabulary (LLaVA's), ignored by the
    others (None: Megatron-LM's default)."""
    if not callable(builder):
        raise TypeError(f"models.build takes a builder function, not {builder!r}")
    require(builder)
    if runtime.current_layout() is None:
        runtime.init_parallel(1, 1)
    if divisible_by is not None and "divisible_by" in inspect.signature(builder).parameters:
        options["divisible_by"] = divisible_by
    return builder(cfg, params_dtype, **options)


# --- forward on the native check's inputs ---------------------------------------------------------

def packed_seq_params(seqlens: Sequence[int], device=None) -> PackedSeqParams:
    """THD parameters for one padding-free sequence of independent images."""
    cu = torch.tensor([0, *seqlens], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    longest = max(seqlens)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def patch_rows(images: Sequence[torch.Tensor], patch: int) -> torch.Tensor:
    """Images (C, H, W) -> (1, ΣN, C·P·P) raster patch rows, each flattened in (C, P, P) order."""
    rows = []
    for img in images:
        c = img.shape[0]
        grid = img.unfold(1, patch, patch).unfold(2, patch, patch)  # (C, h, w, P, P)
        rows.append(grid.permute(1, 2, 0, 3, 4).reshape(-1, c * patch * patch))
    return torch.cat(rows).unsqueeze(0)


@dataclass
class TowerRun:
    """A tower forward: ``tokens`` (ΣN, width) image-major, plus per-image ``grids`` (patches)."""
    tokens: torch.Tensor
    grids: list


def _as_param(model: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    p = next(model.parameters())
    return t.to(p.device, p.dtype)


def run_vit(model, images: Sequence[torch.Tensor]) -> TowerRun:
    """``vit_model.ViTModel`` (merger included when it has one) on images."""
    out, grids = static_or_packed(model, images)
    return TowerRun(out.reshape(-1, out.shape[-1]), grids)


def static_or_packed(tower, images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """A ``vit_model`` tower's forward and the patch grids: one static batch when all sizes agree,
    else the packed (dynamic-resolution) path with THD attention."""
    p = tower.patch_dim
    grids = [(img.shape[-2] // p, img.shape[-1] // p) for img in images]
    if len(set(img.shape for img in images)) == 1:
        return tower(_as_param(tower, torch.stack(list(images)))), grids
    sizes = [tuple(img.shape[-2:]) for img in images]
    return tower(_as_param(tower, patch_rows(images, p)), imgs_sizes=sizes,
                 packed_seq_params=packed_seq_params([h * w for h, w in grids])), grids


def run_clip(model, images: Sequence[torch.Tensor]) -> TowerRun:
    """Stock ``CLIPViTModel``: fixed size only, so each image size is its own batch."""
    p = model.patch_dim
    out = model(_as_param(model, torch.stack(list(images))))
    return TowerRun(out.reshape(-1, out.shape[-1]), [(img.shape[-2] // p, img.shape[-1] // p)
                                                     for img in images])


def run_qwen(model, grids: Sequence[tuple[int, int]], rows: Optional[torch.Tensor] = None,
             pixels: Optional[torch.Tensor] = None):
    """``QwenVLViTModel`` on HF-processor rows (ΣN, C·T·P·P) in block-first order with their
    patch ``grids``, or on a static batch of ``pixels`` (B, C, H, W) (Megatron's static path).

    Returns ``(encoder_tokens, merged)``: Megatron's forward output (merger norm + 2x2 grouping,
    before the merger MLP), and ``QwenPatchMerger.forward`` on the same tower output (Megatron's
    whole merger, HF's ``pooler_output``)."""
    p = model.patch_dim
    seen = {}
    handle = model.decoder.register_forward_hook(lambda mod, args, out: seen.__setitem__("x", out))
    counts = [h * w for h, w in grids]
    try:
        if pixels is not None:
            tokens = model(_as_param(model, pixels))
        else:
            tokens = model(_as_param(model, rows).unsqueeze(0),
                           imgs_sizes=[(h * p, w * p) for h, w in grids],
                           packed_seq_params=packed_seq_params(counts))
    finally:
        handle.remove()
    hidden = seen["x"].transpose(0, 1)
    if pixels is not None:
        merged = model.merger(hidden, *grids[0])
    else:
        merged = torch.cat([model.merger(chunk, h, w) for chunk, (h, w)
                            in zip(hidden.split(counts, dim=1), grids)], dim=1)
    return tokens.reshape(-1, tokens.shape[-1]), merged.reshape(-1, merged.shape[-1])


# --- loading --------------------------------------------------------------------------------------

class StrictLoadError(ValueError):
    """A state dict does not fit Megatron's class; ``missing`` / ``unexpected`` / ``mismatched``
    list the keys (the last as ``key: checkpoint shape vs class shape``)."""

    def __init__(self, missing: list, unexpected: list, mismatched: list):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        parts = [f"{label} {len(keys)}: {compact_keys(keys)}" for label, keys in
                 (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mismatched)) if keys]
        super().__init__("; ".join(parts))


def compact_keys(keys: Sequence[str], limit: int = 8) -> str:
    """Keys with their layer index folded (``decoder.layers.{0..11}.x``), at most ``limit``."""
    folded: dict = {}
    for key in keys:
        parts = key.split(".")
        index = next((i for i, p in enumerate(parts) if p.isascii() and p.isdigit()), None)
        if index is None:
            folded.setdefault(key, [])
            continue
        pattern = ".".join(parts[:index] + ["{}"] + parts[index + 1:])
        folded.setdefault(pattern, []).append(int(parts[index]))
    shown = []
    for pattern, numbers in folded.items():
        if not numbers:
            shown.append(pattern)
        elif len(numbers) == 1:
            shown.append(pattern.replace("{}", str(numbers[0])))
        else:
            shown.append(pattern.replace("{}", "{" + f"{min(numbers)}..{max(numbers)}" + "}"))
    more = f" (+{len(shown) - limit} more)" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more


def load_strict(model: torch.nn.Module, state: dict) -> list[str]:
    """``load_state_dict(strict=True)`` except that missing ``_extra_state`` entries are allowed
    (TE's FP8 metadata: a converted checkpoint has none, and Megatron's own ``LLaVAModel`` load hook
    drops exactly those). Raises :class:`StrictLoadError` naming every other missing, unexpected or
    mis-shaped key, before loading anything. Returns the tolerated keys."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("._extra_state")]
    unexpected = [k for k in state if k not in own]
    mismatched = [f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state
                  if k in own and torch.is_tensor(own[k]) and torch.is_tensor(state[k])
                  and own[k].shape != state[k].shape]
    if missing or unexpected or mismatched:
        raise StrictLoadError(missing, unexpected, mismatched)
    model.load_state_dict(state, strict=False)
    return [k for k in own if k not in state]


def megatron_version() -> str:
    return package_info.__version__


def describe_te() -> str:
    return "transformer engine" if te_stand_ins.HAVE_TE else "cpu stand-ins"
