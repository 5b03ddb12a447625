"""Megatron's own model classes, built from HF configs and run as they are.

This layer sits beside :mod:`mmparity.native`: it imports megatron and torch, never transformers,
and nothing from ``parity``, ``families`` or ``native``. Where ``native`` is mmparity's
re-implementation, ``upstream`` builds the classes a Megatron-LM user trains with (the stock
``CLIPViTModel`` / ``MultimodalProjector`` / ``GPTModel`` / ``LLaVAModel`` of the installed
megatron-core, and ``ViTModel`` / ``QwenVLViTModel`` / ``KimiViTModel`` from Megatron-LM's
``megatron/core/models/vision/vit_model.py`` when that file is importable), so that their state
dicts can be pinned and their outputs compared with HF.

* :mod:`~mmparity.upstream.te_stand_ins`: CPU stand-ins for the Transformer Engine modules those
  classes are specified with, and the layer specs (Megatron's own TE specs, TE swapped for the
  stand-ins only when TE is not importable).
* :mod:`~mmparity.upstream.models`: builders (HF config in, Megatron module out), plain functions
  that each family's Megatron record names (``mmparity.cases.<name>``), and forward functions on
  the inputs the native check uses.

There is no key map: ``converters.hf_to_mcore`` writes the state dict Megatron's class holds
(what it has no place for kept aside, ``McoreShards.side``), so it loads here as is.
"""
