"""Block-scaled FP8 sources (DeepSeek-V3 style): the scheme, dequantize / quantize, and the
grouping of stored keys into the logical ``X.weight`` the rule tables know.

Pure tensors and names: the checkpoint layer (``mmparity.io.quantized``) does the reading.

A quantized linear is stored as ``X.weight`` (float8_e4m3fn, shape ``(..., rows, cols)``) and
``X.weight_scale_inv`` (one float per ``block_m x block_n`` block, ``(..., ceil(rows/block_m),
ceil(cols/block_n))``); its value is ``weight * scale_inv`` blockwise. ``dequantize`` computes
that as transformers' loader (``Fp8Dequantize._dequantize_one``) and DeepSeek's reference kernel
do: both operands in float32, one float32 product, then one cast to the asked dtype. Any other
order (casting the scale to bfloat16 first, as transformers' backward-pass helper does) rounds
twice and differs in the last bit for some elements, so the order is the contract here.

compressed-tensors' INT4 "pack-quantized" format (Kimi-K2's routed experts) is ``PackedInt4Scheme``:
``X.weight_packed`` (int32, eight 4-bit values per word along the input dimension, value ``q + 8``
in bits ``4j..4j+3`` of word ``j // 8``, the last word zero-padded), ``X.weight_scale`` (one scale per
``group_size`` input columns, ``(..., rows, cols / group_size)``), and ``X.weight_shape`` (the
logical shape). The value is ``q.to(scale.dtype) * scale`` in the scale's dtype, then cast once to
the asked dtype: the op order of the ``compressed_tensors`` package's ``PackedQuantizationCompressor``
(``dequantize`` -> ``_dequantize``) followed by transformers' ``.to(dtype)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
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

    def scale_shape(self, weight_shape: Sequence[int]) -> tuple[int, ...]:
        return scale_shape(weight_shape, self.block)

    def stored_entries(self, key: str, shape: Sequence[int], scale: torch.Tensor) -> list[tuple]:
        """(name, dtype, shape) of the stored tensors of logical ``key`` (for a writer's plan)."""
        weight_key, scale_key = quantized_names([key])[key]
        return [(weight_key, FP8_DTYPE, tuple(shape)), (scale_key, scale.dtype, tuple(scale.shape))]

    def stored_tensors(self, key: str, weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        weight_key, scale_key = quantized_names([key])[key]
        return {weight_key: weight, scale_key: scale}

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
    if method == CT_METHOD:
        return parse_compressed_tensors(config)
    if method != FP8_METHOD:
        raise QuantError(f"quantization_config.quant_method {method!r} is not supported; mmparity reads "
                         f"block-scaled FP8 ({FP8_METHOD!r}, fmt e4m3) and {CT_METHOD!r} {CT_FORMAT!r} INT4 only")
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
    if isinstance(scheme, PackedInt4Scheme):
        return dequantize_int4(weight, scale_inv, scheme, dtype)
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


def _refuse_non_finite(value: torch.Tensor, scheme) -> None:
    if not value.is_floating_point() or not value.numel():
        return
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        flat = value.reshape(-1)[~finite.reshape(-1)]
        kinds = [name for name, count in (("+Inf", int((flat == math.inf).sum())),
                                          ("-Inf", int((flat == -math.inf).sum())),
                                          ("NaN", int(flat.isnan().sum()))) if count]
        fmt = "INT4" if isinstance(scheme, PackedInt4Scheme) else "float8_e4m3fn"
        raise QuantError(f"{int(flat.numel())} value(s) are {'/'.join(kinds)}, which {fmt} blocks cannot hold "
                         "(a block's scale would be NaN)")


def quantize(value: torch.Tensor, scheme: QuantScheme,
             scale_inv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, scale_inv)`` of ``value`` in the scheme's format; the inverse of ``dequantize``.

    With ``scale_inv`` (the source's own scales), each block whose values still fit its scale's
    range keeps that scale and is divided by it: a value ``dequantize`` produced, in bfloat16 or
    float32, lies within a rounding of a float8 grid point far below half the grid spacing, so it
    returns to the very bytes it came from. A block that no longer fits (a weight changed since),
    and every block when no scales are given, takes a fresh max-abs scale, computed in the op
    order of transformers' ``Fp8Quantize`` (forward scale ``448 / amax``, stored inverse
    ``1 / scale``, zero blocks scale 1) so that whole-block shapes match its bytes too.

    A value holding ±Inf or NaN is a :class:`QuantError`: neither format holds an infinity (e4m3fn
    has none, INT4 none), and one such value makes its whole block's scale NaN."""
    _refuse_non_finite(value, scheme)
    if isinstance(scheme, PackedInt4Scheme):
        return quantize_int4(value, scheme, scale_inv)
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

    @classmethod
    def merged(cls, parts) -> "RequantError":
        """The report of several processes' shares (their ``to_json``), each tensor counted by one."""
        parts = [cls(**part) for part in parts]
        return cls(sum(p.tensors for p in parts), max((p.max_abs_error for p in parts), default=0.0),
                   sum(p.inexact for p in parts), sum(p.bytes_changed for p in parts))


def requant_error(value: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                  scheme: QuantScheme) -> tuple[float, bool]:
    """(max |dequantize(weight, scale_inv) - value|, whether it is bit-exact) in ``value``'s dtype.
    Non-finite values count: an element that is NaN on one side only, or an infinity the other
    side does not hold, is an error of ``inf`` (a NaN difference would vanish from a maximum);
    NaN on both sides and equal infinities are no error."""
    back = dequantize(weight, scale_inv, scheme, value.dtype)
    exact = torch.equal(back.view(torch.uint8) if back.numel() else back,
                        value.contiguous().view(torch.uint8) if value.numel() else value)
    b, v = back.to(torch.float64), value.to(torch.float64)
    same = (b == v) | (b.isnan() & v.isnan())
    diff = torch.where(same, torch.zeros_like(b), (b - v).abs().nan_to_num(nan=math.inf, posinf=math.inf))
    return (float(diff.max()) if diff.numel() else 0.0), bool(exact)


# --------------------------------------------------------------------------------------------------
# stored keys -> logical tensors


@dataclasses.dataclass(frozen=True)
class QuantGroup:
    """The stored tensors of one logical ``X.weight``."""

    logical: str
    weight: str
    scale: str
    shape: tuple[int, ...] | None = None  # the logical shape where it is not the stored weight's
    shape_key: str | None = None  # compressed-tensors' ``X.weight_shape``


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


def group_keys(scheme: "QuantScheme | PackedInt4Scheme", infos: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
               shapes: Mapping[str, tuple[int, ...]] | None = None) -> QuantLayout:
    """Groups stored keys (name -> (dtype, shape), from headers) into logical tensors. Every scale
    without its weight, fp8 weight without its scale, scale grid that does not fit its weight,
    weight listed in ``modules_to_not_convert`` yet stored quantized, and key of another
    quantization layout is an offender; ``QuantError`` names all of them in one line.

    ``shapes`` (``X.weight_shape`` key -> its values, read by the caller) is for a compressed-tensors
    scheme, whose logical shapes are stored as tensors."""
    if isinstance(scheme, PackedInt4Scheme):
        return group_keys_int4(scheme, infos, shapes or {})
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
    out.update({key: (dtype, tuple(g.shape if g.shape is not None else infos[g.weight][1]))
                for key, g in layout.groups.items()})
    return dict(sorted(out.items()))


def quantized_names(logical: Iterable[str]) -> dict[str, tuple[str, str]]:
    """logical ``X.weight`` -> (stored weight key, stored scale key): the inverse naming of
    ``group_keys``, for writing a re-quantized checkpoint."""
    return {key: (key, key[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX) for key in logical}


# --------------------------------------------------------------------------------------------------
# compressed-tensors "pack-quantized" INT4 (Kimi-K2 / K2.5 routed experts)

CT_METHOD = "compressed-tensors"
CT_FORMAT = "pack-quantized"
PACKED_SUFFIX = ".weight_packed"
CT_SCALE_SUFFIX = ".weight_scale"
SHAPE_SUFFIX = ".weight_shape"
ZERO_POINT_SUFFIX = ".weight_zero_point"
INT4_BITS = 4
INT4_PER_WORD = 32 // INT4_BITS
INT4_MIN, INT4_MAX = -(1 << (INT4_BITS - 1)), (1 << (INT4_BITS - 1)) - 1  # [-8, 7]
INT4_OFFSET = 1 << (INT4_BITS - 1)  # stored unsigned: q + 8
CT_SCALE_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
SHAPE_DTYPES = (torch.int64, torch.int32)
# Weight arguments whose value is the only one read here (None: the key may be absent).
_CT_WEIGHT_ARGS = {"num_bits": (INT4_BITS,), "type": ("int",), "symmetric": (True,), "strategy": ("group",),
                   "dynamic": (False, None), "actorder": (None,), "block_structure": (None,)}
# Keys of the other layouts, refused in a compressed-tensors source.
CT_FOREIGN_SUFFIXES = (SCALE_SUFFIX, ".weight_g_idx", ".weight_global_scale", ".input_scale",
                       ".input_global_scale", ".input_zero_point", ".output_scale", ".k_scale", ".v_scale")


@dataclasses.dataclass(frozen=True)
class PackedInt4Scheme:
    """compressed-tensors' symmetric INT4 group quantization, stored "pack-quantized"; ``config`` is
    the source's ``quantization_config`` verbatim (JSON text), written back on ``--requantize``."""

    group_size: int
    ignore: tuple[str, ...] = ()
    config: str = "{}"
    # The dtype of the source's ``X.weight_shape`` tensors (None: it stores none), set from its headers.
    shape_dtype: str | None = "int64"
    method: str = CT_METHOD
    fmt: str = CT_FORMAT

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.int32

    def to_json(self) -> dict:
        return json.loads(self.config)

    def skips(self, module: str) -> bool:
        """Whether ``ignore`` names ``module`` as compressed-tensors matches a name (``re:`` a regex
        matched from the start, otherwise the whole name)."""
        for target in self.ignore:
            if target.startswith("re:"):
                try:
                    if re.match(target[3:], module):
                        return True
                except re.error:
                    pass
            elif target == module:
                return True
        return False

    def scale_shape(self, weight_shape: Sequence[int]) -> tuple[int, ...]:
        *lead, rows, cols = weight_shape
        return (*lead, rows, cols // self.group_size)

    def packed_shape(self, weight_shape: Sequence[int]) -> tuple[int, ...]:
        *lead, rows, cols = weight_shape
        return (*lead, rows, math.ceil(cols / INT4_PER_WORD))

    def names(self, key: str) -> tuple[str, str, str]:
        base = key[: -len(WEIGHT_SUFFIX)]
        return base + PACKED_SUFFIX, base + CT_SCALE_SUFFIX, base + SHAPE_SUFFIX

    def stored_entries(self, key: str, shape: Sequence[int], scale: torch.Tensor) -> list[tuple]:
        packed_key, scale_key, shape_key = self.names(key)
        out = [(packed_key, torch.int32, self.packed_shape(shape)), (scale_key, scale.dtype, tuple(scale.shape))]
        if self.shape_dtype is not None:
            out.append((shape_key, getattr(torch, self.shape_dtype), (len(shape),)))
        return out

    def stored_tensors(self, key: str, packed: torch.Tensor, scale: torch.Tensor,
                       shape: Sequence[int]) -> dict[str, torch.Tensor]:
        packed_key, scale_key, shape_key = self.names(key)
        out = {packed_key: packed, scale_key: scale}
        if self.shape_dtype is not None:
            out[shape_key] = torch.tensor(list(shape), dtype=getattr(torch, self.shape_dtype))
        return out


def parse_compressed_tensors(config: Mapping) -> PackedInt4Scheme:
    """The scheme of a compressed-tensors ``quantization_config``: only symmetric INT4 weight-only
    group quantization stored ``pack-quantized``, one group size for every config group."""
    problems = []
    fmt = config.get("format")
    if fmt != CT_FORMAT:
        problems.append(f"format {fmt!r} (only {CT_FORMAT!r})")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        problems.append(f"quantization_status {status!r} (only 'compressed')")
    for name in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(name):
            problems.append(f"{name} is set (not supported)")
    groups = config.get("config_groups")
    sizes = set()
    if not isinstance(groups, Mapping) or not groups:
        problems.append(f"config_groups {groups!r:.60} (expected at least one group)")
        groups = {}
    for gname, group in groups.items():
        if not isinstance(group, Mapping):
            problems.append(f"config_groups.{gname} is not an object")
            continue
        if group.get("format") not in (None, CT_FORMAT):
            problems.append(f"config_groups.{gname}.format {group.get('format')!r} (only {CT_FORMAT!r})")
        for act in ("input_activations", "output_activations"):
            if group.get(act) is not None:
                problems.append(f"config_groups.{gname}.{act} is set (activation quantization is not supported)")
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            problems.append(f"config_groups.{gname}.weights {weights!r:.60} (expected INT4 weight arguments)")
            continue
        for arg, allowed in _CT_WEIGHT_ARGS.items():
            value = weights.get(arg, None if None in allowed else "(absent)")
            if value not in allowed:
                problems.append(f"config_groups.{gname}.weights.{arg} {value!r} (only "
                                f"{' or '.join(repr(a) for a in allowed if a is not None) or 'null'})")
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            problems.append(f"config_groups.{gname}.weights.group_size {size!r} (expected a positive integer)")
        else:
            sizes.add(size)
    if len(sizes) > 1:
        problems.append(f"config groups with different group sizes {sorted(sizes)} (one is supported)")
    ignore = config.get("ignore") or ()
    if not isinstance(ignore, (list, tuple)) or not all(isinstance(s, str) for s in ignore):
        problems.append(f"ignore {ignore!r:.60} (expected a list of names)")
    if problems:
        raise _problems(f"quantization_config ({CT_METHOD}) is not supported", problems)
    return PackedInt4Scheme(sizes.pop(), tuple(ignore), json.dumps(dict(config), sort_keys=True))


def _check_int4(shape, packed, scale, stored_shape, scheme: PackedInt4Scheme) -> list[str]:
    """Problems of one group: ``shape`` the logical shape, the others (dtype, shape) pairs (
    ``stored_shape`` the values of ``X.weight_shape``, or None)."""
    (p_dtype, p_shape), (s_dtype, s_shape) = packed, scale
    problems = []
    if p_dtype != torch.int32:
        problems.append(f"packed weight is {str(p_dtype).removeprefix('torch.')}, expected int32")
    if s_dtype not in CT_SCALE_DTYPES:
        problems.append(f"scale is {str(s_dtype).removeprefix('torch.')}, expected bfloat16 or float32")
    if len(shape) < 2:
        return problems + [f"a {len(shape)}-d weight cannot be group-quantized"]
    if shape[-1] % scheme.group_size:
        problems.append(f"{shape[-1]} input columns are not a whole number of groups of {scheme.group_size}")
    if tuple(p_shape) != scheme.packed_shape(shape):
        problems.append(f"packed shape {list(p_shape)} does not fit weight_shape {list(shape)} (expected "
                        f"{list(scheme.packed_shape(shape))}: {INT4_PER_WORD} values per int32)")
    if tuple(s_shape) != scheme.scale_shape(shape):
        problems.append(f"scale shape {list(s_shape)} does not fit weight {list(shape)} in groups of "
                        f"{scheme.group_size} (expected {list(scheme.scale_shape(shape))})")
    return problems


def _int4_shape(packed_shape, scale_shape_, stored_shape, scheme) -> tuple[int, ...]:
    if stored_shape is not None:
        return tuple(int(n) for n in stored_shape)
    return (*packed_shape[:-1], scale_shape_[-1] * scheme.group_size) if len(packed_shape) >= 2 else tuple(packed_shape)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The int8 values ``[-8, 7]`` of an int32 tensor packed eight per word, cut to ``cols``."""
    if sys.byteorder != "little":
        raise QuantError("unpacking int4 needs a little-endian host")
    nibbles = packed.contiguous().view(torch.uint8)
    both = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).flatten(-2)
    return both[..., :cols].to(torch.int8) - INT4_OFFSET


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int32 words of the int8 values ``q`` in ``[-8, 7]``, eight per word along the last dim,
    element ``j`` in bits ``4(j % 8)`` of word ``j // 8``; a last partial word is zero-padded."""
    if sys.byteorder != "little":
        raise QuantError("packing int4 needs a little-endian host")
    cols = q.shape[-1]
    u = (q.to(torch.int16) + INT4_OFFSET).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, -cols % INT4_PER_WORD))
    pairs = u.unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, scheme: PackedInt4Scheme,
                    dtype: torch.dtype = torch.bfloat16, shape: Sequence[int] | None = None) -> torch.Tensor:
    """The value of a packed INT4 weight: ``q.to(scale.dtype) * scale`` per group, in the scale's
    dtype, then one cast to ``dtype`` (the compressed_tensors package's op order, see the module doc)."""
    shape = _int4_shape(tuple(packed.shape), tuple(scale.shape), shape, scheme)
    problems = _check_int4(shape, (packed.dtype, packed.shape), (scale.dtype, scale.shape), shape, scheme)
    if problems:
        raise _problems("cannot dequantize", problems)
    q = unpack_int4(packed, shape[-1]).unflatten(-1, (-1, scheme.group_size))
    return (q.to(scale.dtype) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_int4(value: torch.Tensor, scheme: PackedInt4Scheme,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale)`` of ``value``; the inverse of ``dequantize_int4``.

    With ``scale`` (the source's), each group whose values are within 8.5 scales of zero keeps its
    scale (past ``[-8, 7]`` they clamp, as compressed-tensors' own quantizer clamps ``+amax``): a
    value ``dequantize_int4`` produced is within a relative rounding (2^-8 at worst) of
    ``q * scale``, at most 8 * 2^-8 from ``q`` once divided, so it rounds back to ``q``. Other
    groups, and all when no scale is given, take compressed-tensors' symmetric min-max scale
    ``amax / 8`` (zero groups: the dtype's ``eps``), in the scale's dtype (bfloat16 when none is
    given)."""
    if value.ndim < 2 or value.shape[-1] % scheme.group_size:
        raise QuantError(f"cannot quantize a tensor of shape {list(value.shape)} in groups of {scheme.group_size} "
                         "input columns")
    x = value.to(torch.float32).unflatten(-1, (-1, scheme.group_size))
    out_dtype = scale.dtype if scale is not None else torch.bfloat16
    amax = x.abs().amax(dim=-1)
    fresh = (amax / -INT4_MIN).to(out_dtype)
    fresh = torch.where(fresh == 0, torch.full_like(fresh, torch.finfo(out_dtype).eps), fresh)
    if scale is None:
        chosen = fresh
    else:
        if tuple(scale.shape) != scheme.scale_shape(value.shape):
            raise QuantError(f"scale shape {list(scale.shape)} does not fit weight {list(value.shape)} in groups of "
                             f"{scheme.group_size} (expected {list(scheme.scale_shape(value.shape))})")
        kept = scale.to(torch.float32)
        ratio = x / torch.where(kept > 0, kept, torch.ones_like(kept)).unsqueeze(-1)
        fits = (kept > 0) & (ratio.abs() <= -INT4_MIN + 0.5).all(dim=-1)
        chosen = torch.where(fits, scale, fresh)
    q = torch.round(torch.clamp(x / chosen.to(torch.float32).unsqueeze(-1), INT4_MIN, INT4_MAX))
    return pack_int4(q.flatten(-2).to(torch.int8)), chosen


def group_keys_int4(scheme: PackedInt4Scheme, infos: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                    shapes: Mapping[str, tuple[int, ...]]) -> QuantLayout:
    """``X.weight_packed`` + ``X.weight_scale`` (+ ``X.weight_shape``) -> logical ``X.weight``. A packed
    weight without its scale, a scale or shape without its packed weight, a zero point (the scheme
    is symmetric), a scale or packed shape that does not fit the weight's shape, a module ``ignore``
    lists stored packed, a mixture of groups with and without ``weight_shape``, and a key of another
    quantization layout are offenders, all named in one ``QuantError`` line."""
    problems = []
    groups: dict[str, QuantGroup] = {}
    packed_keys = {k for k in infos if k.endswith(PACKED_SUFFIX)}
    used = set(packed_keys)
    shape_dtypes = set()
    for key in sorted(packed_keys):
        base = key[: -len(PACKED_SUFFIX)]
        logical = base + WEIGHT_SUFFIX
        scale_key, shape_key = base + CT_SCALE_SUFFIX, base + SHAPE_SUFFIX
        if scale_key not in infos:
            problems.append(f"{key} has no scale {scale_key}")
            continue
        used.add(scale_key)
        stored_shape = None
        if shape_key in infos:
            used.add(shape_key)
            dtype, dims = infos[shape_key]
            shape_dtypes.add(dtype)
            if dtype not in SHAPE_DTYPES or len(dims) != 1 or shape_key not in shapes:
                problems.append(f"{shape_key} is {str(dtype).removeprefix('torch.')} {list(dims)}, expected a "
                                "1-d int64 tensor")
                continue
            stored_shape = tuple(int(n) for n in shapes[shape_key])
            if len(stored_shape) != len(infos[key][1]):
                problems.append(f"{shape_key} {list(stored_shape)} does not fit packed {list(infos[key][1])}")
                continue
        else:
            shape_dtypes.add(None)
        shape = _int4_shape(tuple(infos[key][1]), tuple(infos[scale_key][1]), stored_shape, scheme)
        problems += [f"{logical}: {p}" for p in _check_int4(shape, infos[key], infos[scale_key], stored_shape, scheme)]
        if scheme.skips(base):
            problems.append(f"{key} is stored packed but the ignore list names {base}")
        if logical in infos:
            problems.append(f"{logical} is stored both plain and packed")
        groups[logical] = QuantGroup(logical, key, scale_key, shape, shape_key if stored_shape is not None else None)
    if len(shape_dtypes) > 1:
        problems.append("some packed weights have a weight_shape and some do not, or in different dtypes")
    unquantized = []
    for key, (dtype, _shape) in sorted(infos.items()):
        if key in used or key in groups:
            continue
        if key.endswith(ZERO_POINT_SUFFIX):
            problems.append(f"{key} is a zero point, but the scheme is symmetric")
        elif key.endswith((CT_SCALE_SUFFIX, SHAPE_SUFFIX)):
            problems.append(f"{key} has no packed weight {key.rsplit('.', 1)[0] + PACKED_SUFFIX}")
        elif key.endswith(CT_FOREIGN_SUFFIXES):
            problems.append(f"{key} belongs to another quantization layout than pack-quantized int4")
        elif dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int32, torch.int8, torch.uint8):
            problems.append(f"{key} is {str(dtype).removeprefix('torch.')}, neither packed int4 nor a float tensor")
        else:
            unquantized.append(key)
    if problems:
        raise _problems(f"quantized tensors do not fit the {CT_FORMAT} int4 scheme", problems)
    dtype = next(iter(shape_dtypes), "int64")
    shape_dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    return QuantLayout(dataclasses.replace(scheme, shape_dtype=shape_dtype), groups, tuple(unquantized))
