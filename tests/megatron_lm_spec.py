"""Megatron-LM's ``--spec MODULE LAYER`` path without Megatron-LM: its ``get_args`` stood in for
(``--load`` naming a checkpoint root), and the family's class built as ``gpt_builder`` builds it,
on the imported ``LAYER`` with the config Megatron-LM's flags give (``--swiglu``'s SiLU, no
``softmax_scale``: no flag has Gemma's). The family modules these take are those whose ``LAYER``
reads the HF config beside ``--load`` (:mod:`mmparity.models.core.spec_beside`)."""

from __future__ import annotations

import dataclasses

import torch

from mmparity.models import registry as families
from mmparity.parity import harness


def megatron_lm_run(mp, load) -> None:
    """Megatron-LM's ``get_args`` (its ``megatron.training``, Megatron-LM main's only) as a run sets
    it, ``--load`` naming ``load``."""
    import argparse
    import sys
    import types

    training = types.ModuleType("megatron.training")
    training.get_args = lambda: argparse.Namespace(load=str(load), pretrained_checkpoint=None)
    mp.setitem(sys.modules, "megatron.training", training)


def flags_builder(module, flags_config=None):
    """``module``'s class as Megatron-LM's ``gpt_builder`` builds it with ``--spec ... LAYER``: the
    block's config what the flags give, or ``flags_config`` of it."""
    import torch.nn.functional as F

    def build(cfg, params_dtype=torch.float32, **options):
        config = dataclasses.replace(module.megatron_config(cfg.text_config, params_dtype),
                                     activation_func=F.silu, softmax_scale=None)
        config = flags_config(config) if flags_config else config
        return module.build_language_model(cfg, params_dtype, layer=module.LAYER, config=config, **options)
    return build


def check_through_spec(mp, family: str, module, load, flags_config=None, **check):
    """``check --impl megatron`` of ``family`` with its class built through ``--spec`` from a run
    loading ``load``."""
    megatron_lm_run(mp, load)
    module.text_config_beside.cache_clear()
    record = dataclasses.replace(module.LANGUAGE_MODEL, build=flags_builder(module, flags_config))
    mp.setitem(families.get(family).hooks.megatron, "GPTModel", record)
    return harness.check(family, impl="megatron", seed=5, **check)


def config_beside(root, cfg):
    """``root`` holding ``cfg`` as ``convert`` keeps it (``hf_config.json``)."""
    from mmparity.io.layout import HF_CONFIG_FILE

    cfg.save_pretrained(root)
    (root / "config.json").rename(root / HF_CONFIG_FILE)
    return root
