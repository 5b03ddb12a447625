"""The interop study: HF weights -> today's converter -> Megatron's layout -> Megatron's own class.

For a family: seeded HF weights, ``Family.hf_to_mcore`` (the real converter), the key map of
``mmparity.upstream.keymap``, a strict load into the class ``mmparity.upstream.models`` builds
(tolerating only missing ``_extra_state`` entries, exactly as Megatron's ``LLaVAModel`` load hook
does), a forward on the family's parity cases, and the comparison with HF's outputs, output by
output and module by module (the first paired module beyond tolerance names where Megatron's code
departs from HF). Used by ``tests/test_upstream.py`` and ``scripts/megatron_parity.py``.

Phase 2 of the interop work moves this into the parity harness (``check --impl megatron``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import LlavaConfig

from mmparity import families, runtime
from mmparity.cases import inputs
from mmparity.cases.core import Case, sbh_tokens_2d, tokens_2d
from mmparity.parity.metrics import compare, fp32_tolerance
from mmparity.cases import qwen3_5 as ref_qwen
from mmparity.cases.clip import conv_tokens
from mmparity.upstream import keymap, models
from mmparity.upstream.te_stand_ins import cuda_calls_on_host

TOLERANCE = fp32_tolerance().rel_l2
# Megatron's class family -> the mmparity family whose HF model and converter it is fed from.
SOURCE_FAMILY = {"clip_vit": "clip"}


class LoadError(AssertionError):
    pass


def load_strict(model: torch.nn.Module, state: dict) -> list[str]:
    """``load_state_dict`` that fails on any unexpected, missing or mis-shaped key except missing
    ``_extra_state`` entries (TE's FP8 metadata, which a converted checkpoint does not carry and
    Megatron's own load hook ignores). Returns the tolerated keys."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise LoadError(f"strict load failed: missing {missing}, unexpected {result.unexpected_keys}")
    return [k for k in result.missing_keys if k.endswith("._extra_state")]


def tensor_keys(model: torch.nn.Module) -> dict:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def hf_model(family: str, cfg, seed: int):
    """The HF reference with seeded, non-constant weights (the native check's recipe)."""
    fam = families.get(SOURCE_FAMILY.get(family, family))
    ref = fam.build_reference(cfg)
    ref.load_state_dict(inputs.random_like_state(ref.state_dict(), seed), strict=True)
    return ref


def megatron_state(family: str, cfg, hf_state: dict, tp: int, **options) -> tuple[list, dict]:
    source = SOURCE_FAMILY.get(family, family)
    shards = families.get(source).hf_to_mcore(hf_state, cfg, tp_size=tp)
    return keymap.to_megatron(family, shards, cfg, **options)


# --- cases and Megatron-side forwards ------------------------------------------------------------

def family_cases(family: str, cfg, seed: int) -> list[Case]:
    """The native check's cases, restricted to what Megatron's class accepts: stock CLIP/SigLIP
    and ViTModel's learned positions take their configured size only (no resampling), and
    KimiViTModel has no temporal axis (no video case)."""
    source = SOURCE_FAMILY.get(family, family)
    hooks = families.get(source).hooks
    if source in ("clip", "siglip"):
        side = cfg.image_size
        cases = hooks.cases(cfg, seed, image_sizes=[(side, side)] * 2)
    elif family == "pixtral_large":
        # Even grids (which Megatron's merger accepts) for the numbers, and the default odd grids
        # plus a 5x7 one, on which HF drops the last row / column and Megatron's merger raises.
        p = cfg.vision_config.patch_size
        cases = hooks.cases(cfg, seed, image_sizes=[(4 * p, 6 * p), (6 * p, 2 * p)])
        odd = hooks.cases(cfg, seed, image_sizes=[(5 * p, 7 * p), (3 * p, 5 * p)])
        for c in odd:
            c.name = f"odd_{c.name}"
        cases += odd
    elif family == "llava" and cfg.vision_config.model_type != "pixtral":
        side = cfg.vision_config.image_size
        cases = hooks.cases(cfg, seed, image_sizes=[(side, side)] * 2)
    else:
        cases = hooks.cases(cfg, seed)
    cases = [hooks.prepare_case(c, cfg) for c in cases]
    if family == "kimi_k25":
        cases = [c for c in cases if c.name != "video"]
    return cases


def hf_outputs(family: str, ref, case: Case) -> dict:
    source = SOURCE_FAMILY.get(family, family)
    with torch.no_grad():
        return families.get(source).hooks.reference.run(ref, case)


def megatron_outputs(family: str, model, case: Case, cfg) -> dict:
    """Megatron's outputs under the names of the HF outputs they correspond to. An HF output with
    no Megatron counterpart (CLIP's pooled ``ln_post``, SigLIP's head) is absent."""
    with torch.no_grad():
        if family in ("clip", "siglip"):
            groups = ([[img] for img in case.data["images"]] if case.data.get("per_image")
                      else [case.data["images"]])
            return {"last_hidden_state": torch.cat([models.run_clip(model, g).tokens for g in groups])}
        if family == "clip_vit":
            groups = ([[img] for img in case.data["images"]] if case.data.get("per_image")
                      else [case.data["images"]])
            return {"last_hidden_state": torch.cat([models.run_vit(model, g).tokens for g in groups])}
        if family == "pixtral":
            return {"last_hidden_state": models.run_vit(model, case.data["images"]).tokens}
        if family == "pixtral_large":
            merged = models.run_vit(model.vision_model, case.data["images"]).tokens
            return {"merger": merged, "projector": model.vision_projection(merged)}
        if family == "qwen3_5":
            rows, grid_thw = ref_qwen.processor_rows(case, cfg)
            grids = [(h, w) for _, h, w in grid_thw.tolist()]
            if case.data["layout"] == "pixels":
                tokens, merged = models.run_qwen(model, grids, pixels=torch.stack(case.data["images"]))
            else:
                tokens, merged = models.run_qwen(model, grids, rows=rows)
            return {"last_hidden_state": tokens, "pooler_output": merged}
        if family == "kimi_k25":
            if case.name == "projector":
                return {"image_embeds": model.vision_projection(case.data["features"])}
            seen = {}
            handle = model.vision_model.final_ln.register_forward_hook(
                lambda m, a, out: seen.setdefault("x", out))
            try:
                merged, projected = models.run_kimi(model, case.data["images"])
            finally:
                handle.remove()
            out = {"pooler_output": merged, "last_hidden_state": seen["x"].reshape(-1, merged.shape[-1] // 4)}
            if projected is not None:
                out["image_embeds"] = projected
            return {k: v for k, v in out.items() if k in case.outputs}
        if family == "llava":
            return _llava_outputs(model, case, cfg)
    raise KeyError(family)


def _llava_outputs(model, case: Case, cfg) -> dict:
    """Stock ``LLaVAModel`` on the compact batch (one -200 placeholder per image): logits, and
    with labels the per-token loss and Megatron's expanded loss mask, cut to HF's row length."""
    images = torch.stack(case.data["images"])
    images = images.to(next(model.parameters()).dtype)
    ids = case.data["input_ids"]
    tiles = torch.tensor(case.data["num_image_tiles"], dtype=torch.int)
    with cuda_calls_on_host():
        logits, _ = model(images, ids, None, None, num_image_tiles=tiles,
                          runtime_gather_output=True)
        loss, mask = model(images, ids, None, None, labels=case.data["labels"],
                           loss_mask=case.data["loss_mask"], num_image_tiles=tiles)
    keep, vocab = case.data["length"], cfg.text_config.vocab_size
    mask = mask[:, :keep]
    return {"logits": logits[:, :keep, :vocab].reshape(-1, vocab),
            "loss_mask": mask.reshape(-1).float(),
            "token_loss": (loss[:, :keep] * mask).reshape(-1)}


def llava_clip_config():
    """LLaVA with the CLIP tiny tower (what stock megatron-core's LLaVAModel can build): features
    from the penultimate layer, class token dropped (``default``), the llava tiny text model."""
    base = families.get("llava").tiny_config()
    return LlavaConfig(vision_config=families.get("clip").tiny_config(),
                       text_config=base.text_config, image_token_index=base.image_token_index,
                       projector_hidden_act="gelu", vision_feature_layer=-2,
                       vision_feature_select_strategy="default", multimodal_projector_bias=True,
                       tie_word_embeddings=False)


# --- module pairs: where Megatron first departs from HF -----------------------------------------

def _drop_class_rows(extract, class_len: int, tokens_per_image: int):
    """HF CLIP's (B, 1 + N, H) -> its patch rows, to set against ViTModel's ln_pre (patches only)."""
    def run(output, case):
        t = extract(output, case)
        return t.view(-1, class_len + tokens_per_image, t.shape[-1])[:, class_len:].reshape(-1, t.shape[-1])
    return run


def megatron_pairs(family: str, model, cfg) -> list[tuple[str, torch.nn.Module, object]]:
    """(name, Megatron module, extractor) for the names HF's ``pairs`` use; static case only."""
    if family in ("clip", "siglip"):
        out = [("patch_embed", model.conv1, conv_tokens)]
        if model.ln_pre is not None:
            out.append(("ln_pre", model.ln_pre, tokens_2d))
        out += [(f"layer.{i}", layer, sbh_tokens_2d) for i, layer in enumerate(model.decoder.layers)]
        if model.ln_post is not None:
            out.append(("ln_post", model.ln_post, tokens_2d))
        return out
    if family in ("clip_vit", "pixtral"):
        tower = model
    elif family in ("pixtral_large", "kimi_k25"):
        tower = model.vision_model
    else:
        tower = model
    out = []
    if family != "qwen3_5":
        out.append(("patch_embed", tower.patch_embed, tokens_2d))
    if getattr(tower, "ln_pre", None) is not None:
        out.append(("ln_pre", tower.ln_pre, tokens_2d))
    out += [(f"layer.{i}", layer, sbh_tokens_2d) for i, layer in enumerate(tower.decoder.layers)]
    if family == "pixtral_large":
        out += [("merger_norm", tower.merger.pre_norm, tokens_2d), ("merger", tower.merger, tokens_2d),
                ("projector", model.vision_projection, tokens_2d)]
    if family == "qwen3_5":
        out += [("merger.norm", tower.merger.patch_norm, tokens_2d),
                ("merger.linear_fc1", tower.merger.linear_fc1, tokens_2d),
                ("merger.linear_fc2", tower.merger.linear_fc2, tokens_2d)]
    if family == "kimi_k25":
        out.append(("final_layernorm", tower.final_ln, tokens_2d))
        if model.vision_projection is not None:
            out.append(("projector", model.vision_projection, tokens_2d))
    return out


def _capture(named_modules) -> tuple[dict, list]:
    seen: dict = {}
    handles = []
    for name, module in named_modules:
        handles.append(module.register_forward_hook(
            lambda m, a, out, name=name: seen.setdefault(name, out)))
    return seen, handles


def module_divergence(family: str, model, ref, cfg, case: Case) -> list[dict]:
    """Per paired module on ``case``: rel_l2 / max_abs of Megatron's output against HF's."""
    source = SOURCE_FAMILY.get(family, family)
    hf_pairs = {p.name: p for p in families.get(source).hooks.reference.pairs(ref, cfg)}
    mg_pairs = [p for p in megatron_pairs(family, model, cfg) if p[0] in hf_pairs]
    if family == "clip_vit" and "ln_pre" in hf_pairs:
        p = model.patch_dim
        n = (cfg.image_size // p) ** 2
        pair = hf_pairs["ln_pre"]
        hf_pairs["ln_pre"] = type(pair)(pair.name, pair.module, _drop_class_rows(pair.extract, 1, n))
    hf_seen, hf_handles = _capture((n, hf_pairs[n].module) for n, _, _ in mg_pairs)
    mg_seen, mg_handles = _capture((n, m) for n, m, _ in mg_pairs)
    try:
        hf_outputs(family, ref, case)
        megatron_outputs(family, model, case, cfg)
    finally:
        for h in hf_handles + mg_handles:
            h.remove()
    rows = []
    for name, _, extract in mg_pairs:
        if name not in hf_seen or name not in mg_seen:
            continue
        hf_t = hf_pairs[name].extract(hf_seen[name], case)
        mg_t = extract(mg_seen[name], case)
        if hf_t.shape != mg_t.shape:
            rows.append({"module": name, "error": f"shape {tuple(mg_t.shape)} vs HF {tuple(hf_t.shape)}"})
            continue
        m = compare(mg_t, hf_t)
        rows.append({"module": name, "rel_l2": m.rel_l2, "max_abs": m.max_abs})
    return rows


def first_divergence(rows: list[dict], tolerance: float = TOLERANCE) -> Optional[dict]:
    for row in rows:
        if "error" in row or row["rel_l2"] > tolerance:
            return row
    return None


# --- one family, one TP size ----------------------------------------------------------------------

@dataclass
class Study:
    family: str
    tp: int
    side_keys: list
    tolerated_missing: list
    outputs: dict = field(default_factory=dict)  # "case/output" -> {rel_l2, max_abs}
    errors: dict = field(default_factory=dict)  # "case" -> the error Megatron raised
    modules: list = field(default_factory=list)  # static case, per module


def _run_cases(family, model, cfg, cases):
    results, errors = {}, {}
    for case in cases:
        try:
            results[case.name] = megatron_outputs(family, model, case, cfg)
        except Exception as exc:  # a Megatron failure on an input is a finding, recorded as such
            errors[case.name] = f"{type(exc).__name__}: {exc}"
    return results, errors


def _tp_rank(rank: int, world: int, family: str, cfg, seed: int, options: dict):
    runtime.init_parallel(world, 1)
    try:
        ref = hf_model(family, cfg, seed)
        shards, side = megatron_state(family, cfg, ref.state_dict(), world, **_map_options(options))
        model = models.build(family, cfg, **_build_options(family, options))
        tolerated = load_strict(model, shards[rank])
        results, errors = _run_cases(family, model, cfg, family_cases(family, cfg, seed))
        return {"tolerated": tolerated, "side": list(side), "results": results, "errors": errors}
    finally:
        runtime.teardown_parallel()


def _map_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k == "kimi_projection"}


def _build_options(family: str, options: dict) -> dict:
    out = {"parallel_output": False} if family == "llava" else {}
    if family == "kimi_k25" and "kimi_projection" in options:
        out["projection"] = options["kimi_projection"]
    return out


def study(family: str, cfg=None, *, tp: int = 1, seed: int = 0, modules: bool = True,
          **options) -> Study:
    """Convert, map, load strictly, run, compare. TP > 1 runs Megatron on spawned gloo ranks."""
    cfg = cfg if cfg is not None else families.get(SOURCE_FAMILY.get(family, family)).tiny_config()
    ref = hf_model(family, cfg, seed)
    cases = family_cases(family, cfg, seed)
    expected = {c.name: hf_outputs(family, ref, c) for c in cases}
    if tp == 1:
        if runtime.current_layout() is None:
            runtime.init_parallel(1, 1)
        shards, side = megatron_state(family, cfg, ref.state_dict(), 1, **_map_options(options))
        model = models.build(family, cfg, **_build_options(family, options))
        tolerated = load_strict(model, shards[0])
        results, errors = _run_cases(family, model, cfg, cases)
        side_keys = list(side)
    else:
        ranks = runtime.spawn(_tp_rank, tp, family, cfg, seed, options)
        tolerated, side_keys = ranks[0]["tolerated"], ranks[0]["side"]
        results, errors = ranks[0]["results"], ranks[0]["errors"]
        model = None
    out = Study(family, tp, side_keys, tolerated, errors=errors)
    for name, produced in results.items():
        for key, tensor in produced.items():
            metrics = compare(tensor, expected[name][key])
            out.outputs[f"{name}/{key}"] = {"rel_l2": metrics.rel_l2, "max_abs": metrics.max_abs}
    if modules and model is not None:
        static = [c for c in cases if c.name == "static"]
        if static and "static" in results:
            out.modules = module_divergence(family, model, ref, cfg, static[0])
    return out


def worst(s: Study) -> float:
    return max((v["rel_l2"] for v in s.outputs.values()), default=float("nan"))
