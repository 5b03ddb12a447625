"""An HF source stored block-scaled FP8 (DeepSeek-V3 style) or compressed-tensors pack-quantized INT4
(Kimi-K2's routed experts), read as the dequantized tensors it
stands for, so the rule tables (which know only ``X.weight``) plan and convert it unchanged.

Headers first: the logical tensors' shapes and dtypes come from the stored headers, every
weight/scale group is checked against the scheme before a byte is read, and each weight is
dequantized (``mmparity.mapping.quant.dequantize``) only when the conversion reads it.
The source's scales go beside the mcore checkpoint (``QUANT_SCALES_FILE``), so that
``convert --to hf --requantize`` can give back the bytes the source held.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import torch

from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.safetensors_format import MCORE_QUANT_SCALES_FILE
from mmparity.io.fsio.safetensors_read import SafetensorsCheckpoint, TensorInfo
from mmparity.mapping import quant as Q

QUANT_SCALES_FILE = MCORE_QUANT_SCALES_FILE
QUANTIZATION_CONFIG = "quantization_config"
# What an FP8 source dequantizes to when --dtype does not say: DeepSeek-V3's own compute dtype,
# and what transformers' loader gives a bfloat16 model.
DEFAULT_DEQUANT_DTYPE = torch.bfloat16


def read_scheme(config_bytes: bytes, where) -> Q.QuantScheme | None:
    """The quantization scheme a config.json declares (None: none); one-line ``CheckpointError``
    for a scheme mmparity cannot read."""
    try:
        data = json.loads(config_bytes)
    except ValueError:
        return None  # an unreadable config was already refused by whoever read it first
    if not isinstance(data, dict):
        return None
    try:
        return Q.parse_quantization_config(data.get(QUANTIZATION_CONFIG))
    except Q.QuantError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def config_without_quantization(config_bytes: bytes) -> bytes:
    """The config.json of the dequantized model: the same, less ``quantization_config`` (a loader
    that saw it would take bfloat16 weights for FP8 ones)."""
    data = json.loads(config_bytes)
    if QUANTIZATION_CONFIG not in data:
        return config_bytes
    del data[QUANTIZATION_CONFIG]
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def config_with_quantization(config_bytes: bytes, scheme: Q.QuantScheme) -> bytes:
    data = json.loads(config_bytes)
    data[QUANTIZATION_CONFIG] = scheme.to_json()
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


@dataclasses.dataclass(frozen=True)
class QuantRecord:
    """What a manifest records of a quantized source."""

    scheme: "Q.QuantScheme | Q.PackedInt4Scheme"
    dequantized: int
    dtype: str
    scales_file: str = QUANT_SCALES_FILE

    def to_json(self) -> dict:
        if isinstance(self.scheme, Q.PackedInt4Scheme):
            return {"method": self.scheme.method, "format": self.scheme.fmt, "group_size": self.scheme.group_size,
                    "num_bits": Q.INT4_BITS, "ignore": list(self.scheme.ignore), "shape_dtype": self.scheme.shape_dtype,
                    "quantization_config": self.scheme.to_json(), "dequantized": self.dequantized,
                    "dtype": self.dtype, "scales_file": self.scales_file}
        return {"method": self.scheme.method, "fmt": self.scheme.fmt, "weight_block_size": list(self.scheme.block),
                "modules_to_not_convert": list(self.scheme.modules_to_not_convert),
                "dequantized": self.dequantized, "dtype": self.dtype, "scales_file": self.scales_file}

    @classmethod
    def from_json(cls, record: Mapping, where) -> "QuantRecord":
        try:
            if record.get("method") == Q.CT_METHOD:
                scheme = Q.parse_quantization_config(record["quantization_config"])
                if record["shape_dtype"] not in (None, "int64", "int32"):
                    raise Q.QuantError(f"shape_dtype {record['shape_dtype']!r}")
                scheme = dataclasses.replace(scheme, shape_dtype=record["shape_dtype"])
            else:
                scheme = Q.parse_quantization_config({"quant_method": record.get("method"), "fmt": record.get("fmt"),
                                                  "weight_block_size": record.get("weight_block_size"),
                                                  "modules_to_not_convert": record.get("modules_to_not_convert")})
            count, dtype, scales = record["dequantized"], record["dtype"], record["scales_file"]
        except (Q.QuantError, KeyError, AttributeError, TypeError) as exc:
            raise CheckpointError(f"{where}: unreadable quantization record ({exc})") from None
        if scales != QUANT_SCALES_FILE or not isinstance(count, int) or not isinstance(dtype, str):
            raise CheckpointError(f"{where}: unreadable quantization record {dict(record)!r:.200}")
        return cls(scheme, count, dtype, scales)


class DequantizingCheckpoint:
    """A ``SafetensorsCheckpoint`` of a quantized source, seen as its logical tensors: ``infos`` and
    ``map`` as the plain reader's, each group of stored tensors (FP8 weight + scale, or INT4
    packed weight + scale + shape) served as one dequantized ``X.weight``."""

    def __init__(self, ckpt: SafetensorsCheckpoint, scheme: Q.QuantScheme, dtype: torch.dtype | None):
        self.ckpt, self.scheme = ckpt, scheme
        self.dtype = dtype or DEFAULT_DEQUANT_DTYPE
        stored = ckpt.infos()
        shapes = {}
        if isinstance(scheme, Q.PackedInt4Scheme):
            # compressed-tensors stores each logical shape as a tensor: a few integers each, read
            # before planning so that a packed weight that does not fit its shape is refused first.
            shapes = {name: tuple(ckpt.map(name).tolist()) for name, info in stored.items()
                      if name.endswith(Q.SHAPE_SUFFIX) and len(info.shape) == 1 and not info.dtype.is_floating_point
                      and info.dtype != torch.bool}
        try:
            self.layout = Q.group_keys(scheme, {name: (i.dtype, i.shape) for name, i in stored.items()}, shapes)
        except Q.QuantError as exc:
            raise CheckpointError(f"{ckpt.directory}: {exc}") from None
        self.scheme = self.layout.scheme
        self._infos = {name: stored[name] for name in self.layout.unquantized}
        for key, group in self.layout.groups.items():
            weight = stored[group.weight]
            shape = group.shape if group.shape is not None else weight.shape
            self._infos[key] = TensorInfo(key, self.dtype, tuple(shape), weight.file)
        self._infos = dict(sorted(self._infos.items()))
        self.file_ranges = ckpt.file_ranges
        self.directory = ckpt.directory

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def map(self, name: str) -> torch.Tensor:
        group = self.layout.groups.get(name)
        if group is None:
            return self.ckpt.map(name)
        if isinstance(self.scheme, Q.PackedInt4Scheme):
            return Q.dequantize_int4(self.ckpt.map(group.weight), self.ckpt.map(group.scale), self.scheme,
                                     self.dtype, group.shape)
        return Q.dequantize(self.ckpt.map(group.weight), self.ckpt.map(group.scale), self.scheme, self.dtype)

    def scales(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The source's scales by logical key, less ``prefix`` (as the mcore side names HF keys)."""
        return {key[len(prefix):] if key.startswith(prefix) else key:
                self.ckpt.map(group.scale).clone() for key, group in self.layout.groups.items()}

    def record(self) -> QuantRecord:
        return QuantRecord(self.scheme, len(self.layout.groups), str(self.dtype).removeprefix("torch."))
