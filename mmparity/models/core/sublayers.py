"""A transformer layer's paired sub-modules: its norms, attention and MLP, on either side.

A divergence is only useful when it names the smallest thing that went wrong: a fault in an MLP
weight should read ``language_model.decoder.layers.3.mlp``, not ``…layers.3``. Every family pairs
its layers through :func:`layer_pairs`, which puts the sub-modules first, in the order a forward
runs them, and the layer itself last::

    <layer>.input_layernorm, <layer>.self_attention, <layer>.pre_mlp_layernorm, <layer>.mlp, <layer>

The harness reports the first pair in that order that fails, so when a layer and its MLP both
diverge the MLP is named, and an attention fault is named before the MLP it feeds. The sub-modules
take Megatron's names (what the native model and the checkpoint call them) on both sides; where a
side's layer class spells them otherwise, a :class:`LayerNames` record says how.

Framework imports happen where the pairs are built, with the models: the modules that name
pairs are read by commands that build none.

Only what is the same tensor on both sides is paired:

* the norms are the normalised layer input (``TELayerNormColumnParallelLinear`` and its local
  stand-in fuse that norm into the next linear; :class:`~mmparity.models.core.layers.NormedColumnParallelLinear`
  exposes its output as the ``normed`` identity so that it can be hooked; a fused linear that
  does not, Transformer Engine's own, leaves the norm unpaired);
* attention and MLP are their whole output with the output bias added: mcore may hand the bias
  back beside the output (``skip_bias_add``, at TP > 1) where HF's ``o_proj`` / ``fc2`` add it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from mmparity.models.spec import Extractor, Pair

# The sub-modules, by Megatron's names, in the order a pre-norm layer runs them.
SUBLAYERS = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")


@dataclass(frozen=True)
class LayerNames:
    """Where one side's layer class keeps each of :data:`SUBLAYERS` (attribute names; None: it
    has no such module to pair)."""

    input_layernorm: Optional[str]
    self_attention: Optional[str]
    pre_mlp_layernorm: Optional[str]
    mlp: Optional[str]


# transformers' decoder layers (Llama, Mistral, Qwen2, DeepSeek-V3 …).
HF_DECODER = LayerNames("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
# transformers' CLIP and SigLIP encoder layers.
HF_ENCODER = LayerNames("layer_norm1", "self_attn", "layer_norm2", "mlp")
# transformers' Pixtral tower layer.
HF_PIXTRAL = LayerNames("attention_norm", "attention", "ffn_norm", "feed_forward")
# transformers' Qwen-VL and Kimi vision blocks.
HF_VISION_BLOCK = LayerNames("norm1", "attn", "norm2", "mlp")


def _with_output_bias(extract: Extractor) -> Extractor:
    """mcore's ``(output, bias)``: the output with the bias added, as HF's layer computes it."""

    import torch

    def extract_biased(output, case):
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], torch.Tensor):
            output = output[0] + output[1]
        return extract(output, case)

    return extract_biased


def _fused_norm(norm, linear):
    """mcore's norm module, or where it is fused into ``linear`` (``IdentityOp`` in its place),
    the hookable output of that fused norm (None when the linear exposes none)."""
    from megatron.core.transformer.identity_op import IdentityOp

    if norm is not None and not isinstance(norm, IdentityOp):
        return norm
    return getattr(linear, "normed", None)


def mcore_sublayers(layer) -> dict:
    """An mcore ``TransformerLayer``'s sub-modules by :data:`SUBLAYERS` name (None: not pairable)."""
    attention, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    return {"input_layernorm": _fused_norm(getattr(layer, "input_layernorm", None),
                                           getattr(attention, "linear_qkv", None)),
            "self_attention": attention,
            "pre_mlp_layernorm": _fused_norm(getattr(layer, "pre_mlp_layernorm", None),
                                             getattr(mlp, "linear_fc1", None)),
            "mlp": mlp}


def no_inner_pairs(name: str, mlp) -> list[Pair]:
    return []


def layer_pairs(name: str, layer, extract: Extractor, names: Optional[LayerNames] = None,
                inner: Callable[[str, object], list] = no_inner_pairs) -> list[Pair]:
    """The pairs of one layer: its sub-modules (:data:`SUBLAYERS` order), then the layer.

    ``names``: where the layer class keeps them (an HF side); None: an mcore ``TransformerLayer``,
    whose attention and MLP outputs get their output bias added and are copied when produced (the
    bias-dropout-add that follows adds the residual into them in place). ``inner(name, mlp)``: pairs
    inside the MLP (an MoE's router and experts), placed before the MLP's own pair. ``extract``
    is the layer's own extractor: every sub-module's output has the layer's token layout."""
    if layer is None:
        return [Pair(name, None, extract)]
    mcore = names is None
    if mcore:
        modules = mcore_sublayers(layer)
    else:
        modules = {sub: getattr(layer, attr) if attr else None
                   for sub, attr in zip(SUBLAYERS, (names.input_layernorm, names.self_attention,
                                                    names.pre_mlp_layernorm, names.mlp))}
    out = []
    for sub in SUBLAYERS:
        module = modules[sub]
        if module is None:
            continue
        if sub == "mlp":
            out += inner(f"{name}.mlp", module)
        biased = mcore and sub in ("self_attention", "mlp")
        out.append(Pair(f"{name}.{sub}", module, _with_output_bias(extract) if biased else extract,
                        snapshot=mcore))
    out.append(Pair(name, layer, extract))
    return out


def layer_of(name: str, depth: int) -> str:
    """The layer a pair name belongs to, the pair names of a layer's sub-modules included: its
    first ``depth`` dotted parts (``layer.3.mlp`` -> ``layer.3`` at depth 2)."""
    return ".".join(name.split(".")[:depth])
