"""What a checkpoint directory's config says: the HF config itself (config.json, or Mistral's
params.json translated), the family's part of it, bounded by the weights beside it, and the few
facts that tell which family a checkpoint is.

Read once per conversion, here in the conversion layer: the disk layer below is handed the config
as an object and never reads one itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mmparity.config import ConfigType, ConfigViewError, config_view
from mmparity.errors import ConvertError
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import refuse_links_outside, require_regular_file
from mmparity.io.hf import bound_config, read_config_json, refuse_unusable_sizes
from mmparity.io.layout import HF_CONFIG_FILE
from mmparity.models import registry
from mmparity.models.parts.mistral_params import (
    NativeRelease, ParamsError, config_from_params, params_disagreements, release_of)

__all__ = ["HF_CONFIG", "MISTRAL_PARAMS", "read_hf_config", "read_config_facts", "detect_family",
           "family_config", "hf_config_tables"]

HF_CONFIG = "config.json"
MISTRAL_PARAMS = "params.json"


def hf_config_tables() -> dict[str, ConfigType]:
    """Every HF model type config.json is read as without transformers, with its table: the
    ``HF_CONFIGS`` of the registered packages (:func:`mmparity.models.registry.config_modules`),
    in registry order. Two packages declaring one model type is a programming error, named."""
    tables, owners = {}, {}
    for module in registry.config_modules():
        for model_type, table in getattr(module, "HF_CONFIGS", {}).items():
            if model_type in tables:
                raise ValueError(f"model_type {model_type!r} has a config table in both {owners[model_type]} "
                                 f"and {module.__name__}")
            tables[model_type], owners[model_type] = table, module.__name__
    return tables


def _native_releases() -> list[NativeRelease]:
    """What a release in Mistral's own layout may be, as the registered packages declare it."""
    return [module.MISTRAL_NATIVE for module in registry.config_modules() if hasattr(module, "MISTRAL_NATIVE")]


def family_config(spec, config_path: Path, where: Path, capacity: tuple[int, int] | None = None):
    """(the family's config, raw bytes of the HF config file) for the family ``spec``. A source
    directory's config.json may be Mistral's params.json instead (translated, its HF config.json
    bytes returned). ``capacity``: the source's (tensors, elements) from an index it already read
    (``hf.checkpoint_capacity`` otherwise reads the index again: seconds at a release's tensor
    count)."""
    if config_path.name == HF_CONFIG_FILE and not config_path.is_file():
        raise ConvertError(f"{where}: no {HF_CONFIG_FILE} (the HF config an mcore checkpoint needs "
                           "to be converted; mmparity convert keeps the source's config.json there)")
    try:
        full, raw = read_hf_config(where, config_path.name)
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    try:
        cfg = spec.family_config(full)
    except ValueError as exc:
        raise ConvertError(f"{where}: {exc} (family {spec.name!r})") from None
    bound_config(cfg, config_path if config_path.is_file() else where / "params.json", where, capacity)
    return cfg, raw


def read_hf_config(directory: str | os.PathLike, config_name: str = HF_CONFIG, *, for_models: bool = False):
    """``(config, config file bytes)`` of a directory: its ``config_name`` (an HF directory's
    config.json, or the copy an mcore checkpoint keeps), or, for a Mistral-native release with
    only ``params.json``, that file translated (:mod:`mmparity.models.parts.mistral_params`) and the
    HF config.json it amounts to, which is what a converted checkpoint then carries.

    The config is a :class:`mmparity.config.ConfigView` (what transformers would hold, read
    without importing it: conversion needs the facts, not the classes) unless ``for_models``, for
    callers that build transformers' models from it, or its model type has no table there.
    ``CheckpointError`` names the file and what is wrong."""
    directory = Path(directory)
    config_path, params_path = directory / config_name, directory / MISTRAL_PARAMS
    refuse_links_outside(directory, root_names=[n for n in (config_name, MISTRAL_PARAMS)
                                                if os.path.lexists(directory / n)])
    if os.path.lexists(config_path):
        require_regular_file(config_path, "config")
        data = read_config_json(config_path)  # what transformers would read, NaN refused
        refuse_unusable_sizes(data, config_path)  # before any reader divides by them
        tables = {} if for_models else hf_config_tables()
        if data.get("model_type") in tables:
            try:
                config = config_view(data, tables)
            except (ConfigViewError, TypeError, ValueError, KeyError, AttributeError) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise CheckpointError(f"{config_path}: cannot read {config_name}: {first}") from None
        else:
            # Imported here, not above: only a config outside the view's tables pays for transformers.
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(str(config_path), local_files_only=True)
            except Exception as exc:  # transformers raises several types for a bad config
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise CheckpointError(f"{config_path}: cannot read {config_name}: {first}") from None
        refuse_unusable_sizes(config, config_path)  # the derived fields too (head_dim, ...)
        if config_name == HF_CONFIG and os.path.lexists(params_path):
            _check_params_beside(config, config_path, params_path)
        return config, config_path.read_bytes()
    if config_name == HF_CONFIG and os.path.lexists(params_path):
        # The translation builds transformers' config classes (and imports them): only a
        # Mistral-native release pays for transformers.
        try:
            full = config_from_params(read_config_json(params_path))
        except (ParamsError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{params_path}: {exc}") from None
        refuse_unusable_sizes(full, params_path)
        raw = full.to_json_string().encode()
        return (full if for_models else config_view(full.to_dict(), hf_config_tables())), raw
    raise CheckpointError(f"{directory}: no {config_name} (expected an HF save_pretrained directory, or "
                          f"Mistral's {MISTRAL_PARAMS} beside consolidated.safetensors)")


def _check_params_beside(config, config_path: Path, params_path: Path) -> None:
    """A release with both files (Mistral's own beside transformers'): config.json is the one
    read, as transformers reads it, and params.json must describe the same model wherever both
    state a field; otherwise which one the weights follow is anyone's guess."""
    problems = params_disagreements(read_config_json(params_path), config)
    if problems:
        shown = "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")
        raise CheckpointError(f"{config_path} and {params_path} disagree: {shown}; {HF_CONFIG} is the one "
                              f"read: correct the file that does not describe these weights, or remove "
                              f"{MISTRAL_PARAMS}")


def _name(data: dict, key: str, path: Path, where: str = "") -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise CheckpointError(f"{path}: {where}{key} is {json.dumps(value)[:60]}, expected a string")
    return value


def read_config_facts(directory: str | os.PathLike) -> registry.ConfigFacts:
    """What family detection needs from a checkpoint directory: `architectures`, `model_type` and
    `vision_config.model_type` of its config.json, or, for a Mistral-native release without one,
    whether its params.json has a vision encoder. Refuses what any reader of the directory refuses
    (links out of it, non-regular files) and fields of the wrong type; imports no framework."""
    directory = Path(directory)
    present = [n for n in (HF_CONFIG, MISTRAL_PARAMS) if os.path.lexists(directory / n)]
    refuse_links_outside(directory, root_names=present)
    layout = registry.MISTRAL_NATIVE if MISTRAL_PARAMS in present else None
    if HF_CONFIG in present:
        path = directory / HF_CONFIG
        data = read_config_json(path)
        architectures = data.get("architectures") or []
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise CheckpointError(f"{path}: architectures is {json.dumps(architectures)[:60]}, expected a "
                                  "list of class names")
        vision, text = data.get("vision_config"), data.get("text_config")
        for name, sub in (("vision_config", vision), ("text_config", text)):
            if sub is not None and not isinstance(sub, dict):
                raise CheckpointError(f"{path}: {name} is {json.dumps(sub)[:60]}, expected an object")
        return registry.ConfigFacts(HF_CONFIG, tuple(architectures), _name(data, "model_type", path),
                           _name(vision, "model_type", path, "vision_config.") if vision else None, layout,
                           _name(text, "model_type", path, "text_config.") if text else None)
    if layout is not None:
        # Mistral's releases name their vision tower `vision_encoder`; whether it merges patches
        # tells which model the release is (as transformers' conversion scripts decide), and the
        # packages of the models that take such releases say what that is in HF terms.
        params = read_config_json(directory / MISTRAL_PARAMS)
        encoder = params.get("vision_encoder")
        release = release_of(encoder, _native_releases()) if isinstance(encoder, dict) else None
        if release is None:
            return registry.ConfigFacts(MISTRAL_PARAMS, layout=layout)
        return registry.ConfigFacts(MISTRAL_PARAMS, model_type=release.model_type,
                                    vision_model_type=release.vision_model_type, layout=layout,
                                    text_model_type=release.text_model_type)
    raise CheckpointError(f"{directory}: no {HF_CONFIG} (nor Mistral's {MISTRAL_PARAMS}) to tell the family from")


def detect_family(directory: str | os.PathLike) -> registry.Detection:
    """The registered family of the checkpoint in `directory`, from its config
    (:func:`mmparity.models.registry.detect`): `CheckpointError` for a config that cannot be read,
    `mmparity.models.registry.DetectError` when no one family takes it."""
    return registry.detect(read_config_facts(directory))
