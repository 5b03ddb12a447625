"""Checkpoint conversion between HF and mcore state dicts: pure tensors and names.

This package imports neither transformers nor megatron, touches no file and knows no family
registry. :mod:`~mmparity.converters.rules` is the engine (rule tables, planning, the totality
check), :mod:`~mmparity.converters.ops` the layout ops with their inverses,
:mod:`~mmparity.converters.tp` and :mod:`~mmparity.converters.pp` the tensor- and
pipeline-parallel layouts; each family has one module holding its rule table(s) and a
:class:`~mmparity.converters.rules.ConverterSpec`.
"""

from mmparity.converters.rules import ConversionError, ConverterSpec, RuleSet

__all__ = ["ConversionError", "ConverterSpec", "RuleSet"]
