"""HF `save_pretrained`-style safetensors output with an `mmparity.json` manifest, in one atomic step;
the bound every HF config is held to before anything is built from it (read against the weights
a checkpoint holds); and the bounded, finite JSON a config file must be. Which model a config
describes is the conversion layer's to read (``mmparity.convert.configs``)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from mmparity.config import feature_layer_indices
from mmparity.io.layout import LEGACY_FILE
from mmparity.io.manifest import LAYOUT_HF, MANIFEST_FILE, Manifest, Provenance, TensorRecord, write_manifest
from mmparity.io.fsio.bounded import read_json_file
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import require_regular_file
from mmparity.io.fsio.publish import atomic_directory, write_extra_files
from mmparity.io.fsio.safetensors_format import DEFAULT_MAX_SHARD_SIZE, has_hf_weights
from mmparity.io.fsio.safetensors_read import SafetensorsCheckpoint
from mmparity.io.fsio.safetensors_write import write_safetensors_shards
from mmparity.io.fsio.torch_archive import TorchArchive

__all__ = ["write_hf", "bound_config", "checkpoint_capacity", "safetensors_capacity", "torch_dist_capacity",
           "refuse_unusable_sizes", "read_config_json"]


def write_hf(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    provenance: Provenance | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
    force: bool = False,
) -> Path:
    """Writes tensors (a dict or a stream of pairs) as HF safetensors shards plus `mmparity.json`.

    `extra_files` (e.g. `config.json`) land in the same atomic step, so a reader never finds
    weights without their config.
    """
    with atomic_directory(directory, force=force) as staging:
        writer = write_safetensors_shards(staging, tensors, max_shard_size=max_shard_size)
        write_extra_files(staging, extra_files, [*writer.written, MANIFEST_FILE])
        write_manifest(
            staging,
            Manifest(
                layout=LAYOUT_HF,
                tensors=tuple(
                    TensorRecord(writer.weight_map[name], name, checksum) for name, checksum in writer.checksums.items()
                ),
                provenance=provenance or Provenance(),
            ),
        )
    return Path(directory)



# --------------------------------------------------------------------------------------------------
# bounding a config by the weights it describes

# Config fields that count layers: a model is built with one module (and the converter one rule)
# per layer, so these decide how much is allocated before any weight is read.
_LAYER_COUNT = re.compile(r"^(num_hidden_layers|num_layers|n_layers|depth|.*_layers)$")
# Config fields that size tensors.
_WIDTH = re.compile(r"^(.*_)?(hidden_size|intermediate_size|embed_dim|hidden_dim|head_dim|projection_dim|"
                    r"num_attention_heads|num_key_value_heads|num_heads|width)$")
# Ceilings beyond any model these encoders describe, whatever the checkpoint holds.
MAX_LAYERS = 10_000
MAX_WIDTH = 2**20
MAX_VOCAB = 2**24  # sixty times the largest vocabulary released (262k)
# Sizes that are counts of one or more in every model (a layer count, or a secondary width such as
# a shared expert's, may be 0; other configs use some of these names for flags or lists, so only
# these are held to being counts); and the norms' epsilons, small positive numbers.
_COUNTS = re.compile(r"^(hidden_size|num_attention_heads|num_key_value_heads|num_heads|patch_size|image_size|"
                     r"vocab_size|num_channels|embed_dim|intermediate_size|num_hidden_layers)$")
_NONZERO = re.compile(r"^(hidden_size|num_attention_heads|num_heads|patch_size|image_size|vocab_size|num_channels|"
                      r"embed_dim)$")
_EPSILON = re.compile(r"^(.*_)?(rms_norm|layer_norm|norm|ln)_eps(ilon)?$")


def checkpoint_capacity(path: str | os.PathLike) -> tuple[int, int]:
    """(tensors, elements) at most in the checkpoint at `path`: an HF directory, an mcore root or
    iteration directory. Read from safetensors headers, legacy zip directories and DCP metadata,
    never from the data; an upper bound (a legacy storage may be shared, its bytes count as
    elements), which is all a sanity bound needs. A torch_dist tensor of stacked layers counts once
    per layer."""
    from mmparity.io.torch_dist_files import is_torch_dist_dir, load_index

    path = Path(path)
    if has_hf_weights(path):
        with SafetensorsCheckpoint(path) as checkpoint:
            return safetensors_capacity(checkpoint.infos())
    tensors = elements = 0
    candidates = [path] + sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []
    for directory in candidates:
        if is_torch_dist_dir(directory):
            more_tensors, more_elements = torch_dist_capacity(load_index(directory))
            tensors, elements = tensors + more_tensors, elements + more_elements
        for rank_file in sorted(directory.glob(f"mp_rank_*/{LEGACY_FILE}")):
            require_regular_file(rank_file, "rank file")
            try:
                reader = TorchArchive(rank_file)
                records = [r for r in reader.records() if r.startswith("data/")]
                tensors += len(records)
                elements += sum(reader.size(r) for r in records)
            except RuntimeError as exc:
                raise CheckpointError(f"{rank_file}: not a torch.save file ({' '.join(str(exc).split())[:200]})") from None
    return tensors, elements


def safetensors_capacity(infos: Mapping) -> tuple[int, int]:
    """`checkpoint_capacity` from headers already read (a source that holds them reads them once)."""
    return len(infos), sum(math.prod(info.shape) for info in infos.values())


def torch_dist_capacity(metadata) -> tuple[int, int]:
    """`checkpoint_capacity` of one decoded DCP `.metadata` (a stacked tensor counts once per layer)."""
    tensors = elements = 0
    for entry in metadata.state_dict_metadata.values():
        size = tuple(getattr(entry, "size", ()) or ())
        if size:
            tensors += max(1, int(size[0]))
            elements += math.prod(int(n) for n in size)
    return tensors, elements


def bound_config(config, config_path: str | os.PathLike, checkpoint: str | os.PathLike,
                 capacity: tuple[int, int] | None = None) -> None:
    """Refuses a config whose sizes the weights in `checkpoint` cannot back, before anything is
    built from it: a layer count above the number of tensors present (every layer has at least
    one), a width above the number of elements present, or either above a ceiling no real model
    reaches. A `depth` of 1e9 would otherwise build a billion modules and rules (tens of GB) before
    a shape was ever compared. ``capacity``: `checkpoint_capacity` as already read (``check
    --low-memory`` reads the headers without mapping the files)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    problems = _kind_problems(data)
    if problems:
        raise CheckpointError(f"{config_path}: {'; '.join(problems[:4])} (correct the config)")
    tensors, elements = capacity if capacity is not None else checkpoint_capacity(checkpoint)
    for key, value in _int_fields(data):
        name = key.rsplit(".", 1)[-1]
        if _LAYER_COUNT.match(name) and (value > tensors or value > MAX_LAYERS):
            problems.append(f"{key} = {value}, but the checkpoint holds {tensors} tensors" if value > tensors
                            else f"{key} = {value} is beyond the {MAX_LAYERS} layers mmparity accepts")
        elif _WIDTH.match(name) and (value > elements or value > MAX_WIDTH):
            problems.append(f"{key} = {value}, but the checkpoint holds {elements} weights in all" if value > elements
                            else f"{key} = {value} is beyond the width {MAX_WIDTH} mmparity accepts")
        elif name == "vocab_size" and (value > elements or value > MAX_VOCAB):
            problems.append(f"{key} = {value}, but the checkpoint holds {elements} weights in all" if value > elements
                            else f"{key} = {value} is beyond the vocabulary of {MAX_VOCAB} mmparity accepts")
    if problems:
        raise CheckpointError(f"{config_path}: sizes the weights cannot back: {'; '.join(problems[:4])} "
                              "(a config from another model?)")


def _kind_problems(data: dict, prefix: str = "") -> list[str]:
    """Sizes that are not counts (a boolean, a fraction, a negative number; zero where no model has
    none) and epsilons that are not small positive numbers, by key path: each would build a model
    of no meaning, or be published as it is."""
    problems = []
    for key, value in data.items():
        path, name = f"{prefix}{key}", str(key)
        if isinstance(value, dict):
            problems += _kind_problems(value, f"{path}.")
        elif value is None:
            continue
        elif _COUNTS.match(name):
            # A count, or one per axis ("image_size": [h, w]).
            for item in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(item, bool) or not isinstance(item, int):
                    problems.append(f"{path} is {json.dumps(value)[:40]}, not a count")
                    break
                if item < 0 or (item == 0 and _NONZERO.match(name)):
                    problems.append(f"{path} is {json.dumps(value)[:40]}, not a size a model has")
                    break
        elif (_LAYER_COUNT.match(name) or _WIDTH.match(name)) and isinstance(value, int) and value < 0:
            problems.append(f"{path} is {value}, not a size a model has")
        elif _EPSILON.match(name):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                problems.append(f"{path} is {json.dumps(value)[:40]}, not an epsilon (a small positive number)")
    return problems


# Config fields that size or divide something (a width, a head count, a patch, a merge, an expert
# count, a table): zero or less is no model, and would reach a division or an empty shape deep in a
# reader or a model build instead of a message naming the field.
_POSITIVE = re.compile(r"^(.*_)?(hidden_size|intermediate_size|embed_dim|hidden_dim|head_dim|projection_dim|"
                       r"num_attention_heads|num_key_value_heads|num_heads|num_key_heads|num_value_heads|width|"
                       r"patch_size|image_size|merge_size|merge_kernel_size|num_channels|in_channels|vocab_size|"
                       r"max_position_embeddings|num_position_embeddings|pos_emb_height|pos_emb_width|"
                       r"pos_emb_time|lora_rank|conv_kernel_dim|n_group|topk_group|n_routed_experts|"
                       r"num_experts|num_local_experts|num_experts_per_tok|image_seq_length)$")
# Counts that may be zero (no dense leading layers, no shared expert) but never less: a negative one
# names layer -1 or a negative width.
_COUNT = re.compile(r"^(first_k_dense_replace|n_shared_experts|num_shared_experts)$")


def refuse_unusable_sizes(data, config_path: str | os.PathLike) -> None:
    """Refuses a config (a config.json mapping, or a config object with ``to_dict``) holding a size
    of zero or less (:data:`_POSITIVE`), a negative layer count, or a ``vision_feature_layer`` that
    selects no hidden state of its tower, naming the file and the field."""
    values = data.to_dict() if hasattr(data, "to_dict") else data
    for key, value in _int_fields(values, lists=True):
        name = key.rsplit(".", 1)[-1].split("[", 1)[0]
        positive = _POSITIVE.match(name) is not None
        if (positive and value < 1) or ((_LAYER_COUNT.match(name) or _COUNT.match(name)) and value < 0):
            need = "a positive size" if positive else "a count of at least 0"
            raise CheckpointError(f"{config_path}: {key} = {value}, but it must be {need} (a damaged or "
                                  "hand-edited config?); set it to the model's value")
    if getattr(data, "vision_feature_layer", None) is not None and getattr(data, "vision_config", None) is not None:
        try:
            feature_layer_indices(data)
        except (ValueError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{config_path}: {exc}; set vision_feature_layer to a hidden state of the "
                                  "tower (0 .. its layer count, or negative from the last)") from None


def _int_fields(data: dict, prefix: str = "", lists: bool = False):
    """(dotted key, value) of every int in ``data`` and its sub-mappings (with ``lists``, also
    each int of a list, as ``key[i]``)."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _int_fields(value, f"{prefix}{key}.", lists)
        elif isinstance(value, int) and not isinstance(value, bool):
            yield f"{prefix}{key}", value
        elif lists and isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if isinstance(item, int) and not isinstance(item, bool):
                    yield f"{prefix}{key}[{index}]", item


# --------------------------------------------------------------------------------------------------
# a config file as JSON

# Far above any real config (a few kB; tens with label maps): past it the file is no config, and is
# not read into memory.
MAX_CONFIG_BYTES = 2**24


def _non_finite(data) -> str | None:
    """The first place in parsed JSON ``data`` that holds NaN or an infinity (``a.b[2]``), if any.
    Python's json reads NaN, Infinity and -Infinity, which JSON has not; no size, epsilon or RoPE
    base of a model is one, and a config holding one would be published as it is."""
    stack = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "the top level"
        if isinstance(value, dict):
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return None


def read_config_json(path: Path) -> dict:
    """A config file's JSON object, bounded in size, NaN and infinities refused, naming the file."""
    data = read_json_file(path, "config", MAX_CONFIG_BYTES)
    bad = _non_finite(data)
    if bad is not None:
        raise CheckpointError(f"{path}: {bad} is not a finite number (NaN and infinities are no JSON, and no "
                              "size, epsilon or RoPE base of a model); correct the config")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: a JSON {type(data).__name__}, not an object")
    return data
