"""Rule rows of the blocks many tables share, in the names Megatron-LM's Transformer Engine specs
give them: a LayerNorm fused into the linear after it, a linear with its bias, and the pre-norm
two-layer MLP made of both. The HF module names are the caller's: the rows are the same logic
under every family's names, and each row keeps its place in the table's order (the order the
mcore state dict is written in)."""

from __future__ import annotations

from mmparity.mapping.rules import Rule, rename


def fused_layer_norm_rules(mcore: str, hf: str) -> tuple[Rule, Rule]:
    """The weight and bias of the HF LayerNorm ``hf``, held by the mcore linear ``mcore``
    (``....linear_qkv.`` or ``....linear_fc1.``) that TE fuses it into."""
    return (rename(mcore + "layer_norm_weight", hf + ".weight"), rename(mcore + "layer_norm_bias", hf + ".bias"))


def linear_rules(mcore: str, hf: str, tp: str) -> tuple[Rule, Rule]:
    """A linear with a bias, ``tp`` ``column`` or ``row``: a column-parallel bias splits with the
    weight's rows; a row-parallel layer adds its bias once after the reduction, so every rank
    holds all of it."""
    return (rename(mcore + ".weight", hf + ".weight", tp),
            rename(mcore + ".bias", hf + ".bias", "column" if tp == "column" else "replicated"))


def normed_mlp_rules(mcore: str, norm: str, fc1: str, fc2: str) -> tuple[Rule, ...]:
    """A biased two-layer MLP under ``mcore`` (``....mlp.``) whose LayerNorm lives in its
    ``linear_fc1``, from the HF modules ``norm``, ``fc1`` and ``fc2``."""
    return (*fused_layer_norm_rules(mcore + "linear_fc1.", norm),
            *linear_rules(mcore + "linear_fc1", fc1, "column"), *linear_rules(mcore + "linear_fc2", fc2, "row"))
