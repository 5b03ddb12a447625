"""The parallel axes (:mod:`mmparity.axes`) as the converters read them, with how a tensor axis
cuts a tensor: by the tensor's TP split kind (``converters.tp``).

Pure: no framework import.
"""

from __future__ import annotations

from mmparity.axes import (SPLITS, Axis, AxisError, Grid, PipelineError, expert_axis, no_experts, pipeline_axis,
                           tensor_axis)
from mmparity.converters import tp as tp_mod

__all__ = ["AxisError", "PipelineError", "Axis", "Grid", "SPLITS", "no_experts", "tensor_axis", "pipeline_axis",
           "expert_axis", "split_of"]


def split_of(axis: Axis, kind: str) -> tp_mod.Split:
    """How a tensor of TP split ``kind`` is cut along ``axis`` (a tensor axis)."""
    if axis.splits != "tensors":
        raise AxisError(f"axis {axis.name} splits {axis.splits}, not tensors")
    return tp_mod.split_of(kind)
