"""Block-scaled FP8 sources (DeepSeek-V3 style): the scheme, dequantize / quantize, and the
grouping of stored keys into the logical ``X.weight`` the rule tables know.

Pure tensors and names: the checkpoint layer (``mmparity.checkpoint.quantized``) does the reading.

A quantized linear is stored as ``X.weight`` (float8_e4m3fn, shape ``(..., rows, cols)``) and
``X.weight_scale_inv`` (one float per ``block_m x block_n`` block, ``(..., ceil(rows/block_m),
ceil(cols/block_n))``); its value is ``weight * scale_inv`` blockwise. ``dequantize`` computes
that as transformers' loader (``Fp8Dequantize._dequantize_one``) and DeepSeek's reference kernel
do: both operands in float32, one float32 product, then one cast to the asked dtype. Any other
order (casting the scale to bfloat16 first, as transformers' backward-pass helper does) rounds
twice and differs in the last bit for some elements, so the order is the contract here.

compressed-tensors' INT4 "pack-quantized" format (Kimi-K2) is refused: transformers delegates its
unpacking to the external ``compressed_tensors`` package and does not describe the bit layout.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence

import torch

FP8_METHOD = "fp8"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
FP8_MIN = torch.finfo(FP8_DTYPE).min
WEIGHT_SUFFIX = ".weight"
SCALE_SUFFIX = ".weight_scale_inv"
# Keys of the other quantization layouts: their presence in an fp8 source means a mixed or
# mislabelled checkpoint, which is refused rather than converted with those tensors left over.
FOREIGN_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point",
                    ".input_scale", ".activation_scale")
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Half the e4m3 step above its largest value (448; the next step, 480, would be NaN): a quotient
# below 448 + 16 rounds to 448 anyway, so clamping it loses nothing rounding would not.
FP8_TOP_HALF_STEP = 16.0
_MAX_SHOWN = 4


class QuantError(ValueError):
    """A quantization scheme or a group of quantized tensors that cannot be converted; the message
    is one line naming every offender."""


def _problems(title: str, problems: Sequence[str]) -> QuantError:
    shown = "; ".join(problems[:_MAX_SHOWN])
    more = f" (+{len(problems) - _MAX_SHOWN} more)" if len(problems) > _MAX_SHOWN else ""
    return QuantError(f"{title}: {shown}{more}")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """A source's quantization, from its config.json ``quantization_config``."""

    method: str
    block: tuple[int, int]  # (block_m, block_n): rows x columns of the weight one scale covers
    fmt: str = "e4m3"
    modules_to_not_convert: tuple[str, ...] = ()

    @property
    def weight_dtype(self) -> torch.dtype:
        return FP8_DTYPE

    def to_json(self) -> dict:
        return {"quant_method": self.method, "fmt": self.fmt, "weight_block_size": list(self.block),
                "activation_scheme": "dynamic", "modules_to_not_convert": list(self.modules_to_not_convert)}

    @classmethod
    def from_json(cls, record: Mapping) -> "QuantScheme":
        return parse_quantization_config(record)

    def skips(self, module: str) -> bool:
        """Whether ``modules_to_not_convert`` names ``module``, matched as transformers matches it
        (a prefix up to a module boundary, a regex with that boundary, or a suffix)."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        for pattern in self.modules_to_not_convert:
            try:
                if re.match(rf"(?:{pattern}){boundary}", module):
                    return True
            except re.error:
                pass
            if module.endswith(pattern):
                return True
        return False


def parse_quantization_config(config: Mapping | None) -> QuantScheme | None:
    """The scheme of a config.json ``quantization_config`` (None: an unquantized source). Anything
    but DeepSeek-style block-scaled FP8 with dynamic activations raises ``QuantError``."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise QuantError(f"quantization_config is {type(config).__name__}, expected an object")
    method = config.get("quant_method")
    if method != FP8_METHOD:
        detail = f" (format {config.get('format')!r})" if method == "compressed-tensors" else ""
        raise QuantError(f"quantization_config.quant_method {method!r}{detail} is not supported; mmparity "
                         f"reads block-scaled FP8 ({FP8_METHOD!r}, fmt e4m3) only")
    problems = []
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        problems.append(f"fmt {fmt!r} (only 'e4m3')")
    activation = str(config.get("activation_scheme", "dynamic")).lower()
    if activation != "dynamic":
        problems.append(f"activation_scheme {activation!r} (only 'dynamic': static input scales have no "
                        "place in a dequantized model)")
    for name, expected in (("scale_fmt", "float"), ("expert_dtype", "fp8")):
        if config.get(name, expected) != expected:
            problems.append(f"{name} {config.get(name)!r} (only {expected!r})")
    block = config.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        problems.append(f"weight_block_size {block!r} (expected two positive integers)")
    skip = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        problems.append(f"modules_to_not_convert {skip!r} (expected a list of names)")
    if problems:
        raise _problems("quantization_config (fp8) is not supported", problems)
    return QuantScheme(FP8_METHOD, (block[0], block[1]), fmt, tuple(skip))


def scale_shape(weight_shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight: one scale per block, the last blocks of a row or column partial."""
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def _expand(scale: torch.Tensor, shape: Sequence[int], block: tuple[int, int]) -> torch.Tensor:
    """``scale`` repeated over its blocks and cut to the weight's shape (partial edge blocks)."""
    rows, cols = shape[-2:]
    grown = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return grown[..., :rows, :cols]


def _check_pair(weight_shape, weight_dtype, scale_shape_, scale_dtype, block) -> list[str]:
    problems = []
    if len(weight_shape) < 2:
        problems.append(f"a {len(weight_shape)}-d weight cannot be block-scaled")
        return problems
    if weight_dtype != FP8_DTYPE:
        problems.append(f"weight is {str(weight_dtype).removeprefix('torch.')}, expected float8_e4m3fn")
    if scale_dtype not in SCALE_DTYPES:
        problems.append(f"scale is {str(scale_dtype).removeprefix('torch.')}, expected float32")
    expected = scale_shape(weight_shape, block)
    if tuple(scale_shape_) != expected:
        problems.append(f"scale shape {list(scale_shape_)} does not fit weight {list(weight_shape)} in "
                        f"{block[0]}x{block[1]} blocks (expected {list(expected)})")
    return problems


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, scheme: QuantScheme,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The value of a quantized weight in ``dtype``: float32 ``weight * scale_inv`` per block, cast
    once (the op order of transformers' loader, see the module doc)."""
    problems = _check_pair(tuple(weight.shape), weight.dtype, tuple(scale_inv.shape), scale_inv.dtype,
                           scheme.block)
    if problems:
        raise _problems("cannot dequantize", problems)
    product = weight.to(torch.float32) * _expand(scale_inv.to(torch.float32), weight.shape, scheme.block)
    return product.to(dtype)


def _blocks_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Max |x| per block; edge blocks are padded with zeros, which never raise a maximum."""
    *lead, rows, cols = x.shape
    grid = scale_shape(x.shape, block)
    padded = torch.nn.functional.pad(x.abs(), (0, grid[-1] * block[1] - cols, 0, grid[-2] * block[0] - rows))
    return padded.reshape(*lead, grid[-2], block[0], grid[-1], block[1]).amax(dim=(-3, -1))


def quantize(value: torch.Tensor, scheme: QuantScheme,
             scale_inv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, scale_inv)`` of ``value`` in the scheme's format; the inverse of ``dequantize``.

    With ``scale_inv`` (the source's own scales), each block whose values still fit its scale's
    range keeps that scale and is divided by it: a value ``dequantize`` produced, in bfloat16 or
    float32, lies within a rounding of a float8 grid point far below half the grid spacing, so it
    returns to the very bytes it came from. A block that no longer fits (a weight changed since),
    and every block when no scales are given, takes a fresh max-abs scale, computed in the op
    order of transformers' ``Fp8Quantize`` (forward scale ``448 / amax``, stored inverse
    ``1 / scale``, zero blocks scale 1) so that whole-block shapes match its bytes too."""
    if value.ndim < 2:
        raise QuantError(f"cannot quantize a {value.ndim}-d tensor in {scheme.block[0]}x{scheme.block[1]} blocks")
    x = value.to(torch.float32)
    amax = _blocks_amax(x, scheme.block)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    forward = FP8_MAX / safe
    forward = torch.where(amax > 0, forward, torch.ones_like(forward))
    fresh_inv = (1.0 / forward).to(torch.float32)
    if scale_inv is None:
        scaled = x * _expand(forward, x.shape, scheme.block)
        out_scale = fresh_inv
    else:
        expected = scale_shape(x.shape, scheme.block)
        if tuple(scale_inv.shape) != expected:
            raise QuantError(f"scale shape {list(scale_inv.shape)} does not fit weight {list(x.shape)} in "
                             f"{scheme.block[0]}x{scheme.block[1]} blocks (expected {list(expected)})")
        kept = scale_inv.to(torch.float32)
        fits = (kept > 0) & (amax / torch.where(kept > 0, kept, torch.ones_like(kept)) < FP8_MAX + FP8_TOP_HALF_STEP)
        by_kept = x / _expand(torch.where(fits, kept, torch.ones_like(kept)), x.shape, scheme.block)
        by_fresh = x * _expand(forward, x.shape, scheme.block)
        scaled = torch.where(_expand(fits, x.shape, scheme.block), by_kept, by_fresh)
        out_scale = torch.where(fits, kept, fresh_inv).to(scale_inv.dtype)
    weight = torch.clamp(scaled, min=FP8_MIN, max=FP8_MAX).to(FP8_DTYPE)
    return weight, out_scale


@dataclasses.dataclass(frozen=True)
class RequantError:
    """What re-quantizing did to a set of weights: the largest |dequantize(quantize(w)) - w| and how
    many tensors changed (their values do not come back exactly, or their bytes are not the
    source's where the source's digest is known)."""

    tensors: int = 0
    max_abs_error: float = 0.0
    inexact: int = 0  # tensors whose dequantized values differ from what was exported
    bytes_changed: int = 0  # tensors whose quantized bytes differ from the source's

    def add(self, error: float, exact: bool, same_bytes: bool) -> "RequantError":
        return RequantError(self.tensors + 1, max(self.max_abs_error, error), self.inexact + (not exact),
                            self.bytes_changed + (not same_bytes))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def requant_error(value: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                  scheme: QuantScheme) -> tuple[float, bool]:
    """(max |dequantize(weight, scale_inv) - value|, whether it is bit-exact) in ``value``'s dtype."""
    back = dequantize(weight, scale_inv, scheme, value.dtype)
    exact = torch.equal(back.view(torch.uint8) if back.numel() else back,
                        value.contiguous().view(torch.uint8) if value.numel() else value)
    diff = (back.to(torch.float64) - value.to(torch.float64)).abs()
    return (float(diff.max()) if diff.numel() else 0.0), bool(exact)


# --------------------------------------------------------------------------------------------------
# stored keys -> logical tensors


@dataclasses.dataclass(frozen=True)
class QuantGroup:
    """The stored tensors of one logical ``X.weight``."""

    logical: str
    weight: str
    scale: str


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """How a quantized source's keys make its logical tensors: ``groups`` (logical key -> stored
    pair) are dequantized on read; ``unquantized`` keys (norms, embeddings, router gates,
    ``modules_to_not_convert``) are served as stored."""

    scheme: QuantScheme
    groups: Mapping[str, QuantGroup]
    unquantized: tuple[str, ...]

    def logical_keys(self) -> list[str]:
        return sorted([*self.groups, *self.unquantized])


def group_keys(scheme: QuantScheme, infos: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> QuantLayout:
    """Groups stored keys (name -> (dtype, shape), from headers) into logical tensors. Every scale
    without its weight, fp8 weight without its scale, scale grid that does not fit its weight,
    weight listed in ``modules_to_not_convert`` yet stored quantized, and key of another
    quantization layout is an offender; ``QuantError`` names all of them in one line."""
    problems = []
    groups: dict[str, QuantGroup] = {}
    scale_keys = {k for k in infos if k.endswith(SCALE_SUFFIX)}
    for key in sorted(scale_keys):
        base = key[: -len(SCALE_SUFFIX)]
        weight_key = base + WEIGHT_SUFFIX
        if weight_key not in infos:
            problems.append(f"{key} has no weight {weight_key}")
            continue
        (w_dtype, w_shape), (s_dtype, s_shape) = infos[weight_key], infos[key]
        problems += [f"{weight_key}: {p}" for p in _check_pair(w_shape, w_dtype, s_shape, s_dtype, scheme.block)]
        if scheme.skips(base):
            problems.append(f"{weight_key} is stored quantized but modules_to_not_convert lists {base}")
        groups[weight_key] = QuantGroup(weight_key, weight_key, key)
    unquantized = []
    for key, (dtype, _shape) in sorted(infos.items()):
        if key in scale_keys or key in groups:
            continue
        if key.endswith(FOREIGN_SUFFIXES):
            problems.append(f"{key} belongs to another quantization layout than fp8 weight_scale_inv")
        elif dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            problems.append(f"{key} is {str(dtype).removeprefix('torch.')} but has no {SCALE_SUFFIX.lstrip('.')}")
        else:
            unquantized.append(key)
    if problems:
        raise _problems("quantized tensors do not fit the fp8 scheme", problems)
    return QuantLayout(scheme, groups, tuple(unquantized))


def logical_infos(layout: QuantLayout, infos: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                  dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every logical tensor, without reading a byte: dequantized ones in ``dtype``."""
    out = {key: infos[key] for key in layout.unquantized}
    out.update({key: (dtype, tuple(infos[g.weight][1])) for key, g in layout.groups.items()})
    return dict(sorted(out.items()))


def quantized_names(logical: Iterable[str]) -> dict[str, tuple[str, str]]:
    """logical ``X.weight`` -> (stored weight key, stored scale key): the inverse naming of
    ``group_keys``, for writing a re-quantized checkpoint."""
    return {key: (key, key[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX) for key in logical}
