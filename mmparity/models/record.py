"""The records a family's package and a language-model part's package hand the registry, in their
``__init__`` (``FAMILY``, ``PART``): display and detection data only, so reading them imports no
framework and none of the package's modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A layout told by the files rather than by config.json: Mistral's own release, ``params.json``
# beside ``consolidated.safetensors``.
MISTRAL_NATIVE = "mistral_native"

def lazy(target: str) -> Callable:
    """``"module:function"`` as a function that imports its module when first called: a record
    names code of its package without importing it (listing families imports no family code)."""
    module, _, name = target.partition(":")

    def call(*args, **kwargs):
        import importlib

        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = target
    return call


@dataclass(frozen=True)
class Takes:
    """One kind of checkpoint, as its config names it; every field given must match.

    ``architecture``: one of config.json's ``architectures``; ``model_type``: its ``model_type``;
    ``vision_model_type``: its ``vision_config.model_type``, for whole-VLM configs whose tower
    decides which family converts the vision part; ``text_model_type``: its
    ``text_config.model_type``, where the language model tells two whole families apart (Pixtral-12B
    from another LLaVA); ``layout``: a layout the files tell (:data:`MISTRAL_NATIVE`).
    """

    architecture: str | None = None
    model_type: str | None = None
    vision_model_type: str | None = None
    layout: str | None = None
    text_model_type: str | None = None

    def matches(self, facts) -> frozenset | None:
        """The facts this confirms, or None when one of its fields does not match."""
        wanted = {name: value for name in ("architecture", "model_type", "vision_model_type", "layout",
                                           "text_model_type")
                  if (value := getattr(self, name)) is not None}
        for name, value in wanted.items():
            if (value not in facts.architectures if name == "architecture" else getattr(facts, name) != value):
                return None
        return frozenset(wanted.items())


@dataclass(frozen=True)
class FamilyRecord:
    """A family's record: the ``FAMILY`` of its package's ``__init__``. ``name`` and ``package`` are
    the registry's to fill in (the package's last name, and its dotted path)."""

    summary: str
    reference_classes: tuple
    # What ``check`` compares, for ``mmparity list``: paired modules and components.
    compared: tuple = ()
    checkpoint_note: str = ""
    # Which checkpoints ``check --hf`` and ``convert`` without ``--family`` give this family, read
    # off the config alone: those it converts whole, and whole-VLM ones it converts only part of
    # (a tower family on a LLaVA, the vision path of a Mistral3). A family that takes a
    # checkpoint whole is preferred over one taking part; the report of a partial conversion
    # names it. ``--family`` picks any family, listed here or not.
    takes_whole: tuple = ()
    takes_part: tuple = ()
    # A whole VLM composed as Megatron's LLaVAModel (``cases.llava``): its key tables are LLaVA's
    # (``mmparity.models.llava.mapping``) over the registered vision tower its config names, not a
    # ``mapping`` module of its own.
    composed: bool = False
    # Built of registered parts with its own key table (not LLaVA's): its hooks are given the
    # tower and the language-model lookups, as a composed family's are.
    with_language: bool = False
    # ``check --low-memory`` reproduces its in-memory report (one module's weights resident at a
    # time); a family whose models that path cannot drive yet says False.
    low_memory: bool = True
    # Megatron-LM arguments its model needs that neither the HF config's common fields nor the
    # tensors tell, as ``(name, value)`` pairs: recorded in a converted checkpoint's ``args``.
    megatron_args: tuple = ()
    # Those of them that differ from config to config (sliding windows, the layers without RoPE,
    # the ``--spec`` a run must be given): a function of the model's config giving ``{name:
    # value}``, recorded beside ``megatron_args``. Read by ``convert``: the config alone.
    megatron_config_args: Callable[[Any], dict] | None = None
    # The Megatron class that holds the whole model, as a converted checkpoint's manifest names
    # it: a function of the model's config giving the class name, or "" where none can be built
    # for that model (a LLaVA on a Pixtral tower loads part by part). Read by ``convert``, so it
    # looks at the config alone (no model code); tests hold it to the family's Megatron hooks.
    megatron_whole: Callable[[Any], str] | None = None
    name: str = ""
    package: str = ""

    def takes(self, facts) -> tuple[int, int]:
        """How well this family takes a checkpoint: (2 whole, 1 part, 0 not at all; how many facts
        of the config say so)."""
        for level, kinds in ((2, self.takes_whole), (1, self.takes_part)):
            confirmed = [m for t in kinds if (m := t.matches(facts)) is not None]
            if confirmed:
                return level, len(frozenset().union(*confirmed))
        return 0, 0


@dataclass(frozen=True)
class PartRecord:
    """A language-model part of whole VLMs (``PART`` in its package's ``__init__``): the HF text
    model types it takes; its package's modules are ``mapping`` (``SPEC``, a ``LanguageKeys``: rules
    per layout), ``native`` (``transformer_config``, ``LanguageModelBuilder``) and ``reference``
    (``decoder_shapes``); either side may add ``mlp_pairs(name, mlp, extract)``, the pairs inside a
    layer's MLP (an MoE's router and experts; without it the MLP is paired whole). A composed family finds its language model here by
    ``text_config.model_type``, as it finds its tower among the families.

    ``megatron``: where Megatron's class for the part is built, ``"module:function"`` (a builder
    ``(whole cfg, params_dtype, divisible_by=, parallel_output=)`` of the part alone, as
    ``mmparity.models.parts.dense_decoder.megatron.build_language_model``); every whole VLM composed with the part
    checks and loads its ``language_model.*`` in it. Empty: Megatron has no class for it, and
    ``why_no_megatron`` says why."""

    summary: str
    text_model_types: tuple
    megatron: str = ""
    why_no_megatron: str = ""
    # As a family's: the Megatron-LM arguments no common fact tells, recorded in ``args``; those
    # that differ by config, a function of the text config (the part's own).
    megatron_args: tuple = ()
    megatron_config_args: Callable[[Any], dict] | None = None
    # The registry's to fill in, as a family's.
    name: str = ""
    package: str = ""
