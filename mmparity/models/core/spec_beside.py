"""What a ``--spec`` layer of Megatron-LM reads beside the checkpoint a run loads: the HF text
config that ``mmparity convert`` keeps as ``hf_config.json`` at the root ``--load`` names.

A ``ModuleSpec`` that Megatron-LM's ``--spec MODULE NAME`` imports is built with nothing past the
config its flags give, and some of a model's function has no flag (Gemma's tanh GeGLU, its
attention scale, Gemma 4's per-layer widths). A family's layer class reads those from the file when
the block builds it, checks what the flags can say against the same file (one line naming the flag
where they differ) and builds the real layer. The families differ only in which config they read
and which layer they build; the reading, the run's ``--load`` and the comparison are here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mmparity.config import config_view
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.paths import refuse_links_outside
from mmparity.io.hf import read_config_json, refuse_unusable_sizes
from mmparity.io.layout import HF_CONFIG_FILE

# What Megatron-LM's flags cannot say for a Gemma layer (its config-derived flags leave both out),
# taken from the HF config: the tanh GeGLU (``--swiglu`` gives the gated layout with SiLU) and the
# attention scale.
NOT_IN_FLAGS = ("activation_func", "softmax_scale")
# What they can, checked against the HF config: the flag, then the TransformerConfig field it sets.
FLAGS = (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"), ("--ffn-hidden-size", "ffn_hidden_size"),
         ("--num-attention-heads", "num_attention_heads"), ("--num-query-groups", "num_query_groups"),
         ("--kv-channels", "kv_channels"), ("--normalization", "normalization"),
         ("--norm-epsilon", "layernorm_epsilon"), ("--apply-layernorm-1p", "layernorm_zero_centered_gamma"),
         ("--qk-layernorm", "qk_layernorm"), ("--swiglu", "gated_linear_unit"),
         ("--disable-bias-linear", "add_bias_linear"), ("--window-size", "window_size"),
         ("--window-attn-skip-freq", "window_attn_skip_freq"))


def spec_flag(spec: tuple) -> str:
    """``--spec MODULE NAME`` as a user types it."""
    return " ".join(("--spec",) + tuple(spec))


def run_root(spec: tuple, needs: str) -> str:
    """The checkpoint root of the Megatron-LM run building ``spec``: its own ``args.load`` (or
    ``--pretrained-checkpoint``), never an environment variable, so what launched the run cannot
    leak into the model. ``needs``: what the file says that the flags cannot, for the refusal."""
    from megatron.training import get_args  # Megatron-LM's own globals: only a run of it builds these layers

    args = get_args()
    root = getattr(args, "load", None) or getattr(args, "pretrained_checkpoint", None)
    if not root:
        raise ValueError(f"{spec_flag(spec)} needs --load: the checkpoint mmparity convert wrote, whose "
                         f"{HF_CONFIG_FILE} says {needs}")
    return str(root)


def read_text_config(root: str, *, spec: tuple, model: str, tables: dict, needs: str):
    """(the text config view, the file's path) of the ``hf_config.json`` at ``root`` (read
    bounded, NaN and unusable sizes refused, as every config is): the file's own config where its
    ``model_type`` is one of ``tables``, else its ``text_config``; ``model`` names the model in the
    refusals."""
    path = Path(root) / HF_CONFIG_FILE
    if not (path.is_symlink() or path.exists()):
        raise CheckpointError(f"{path}: not found; {spec_flag(spec)} reads {needs} from the {HF_CONFIG_FILE} "
                              f"mmparity convert writes: point --load at the directory convert wrote (saving into "
                              f"it, --save = --load, keeps the file) or copy its {HF_CONFIG_FILE} there")
    refuse_links_outside(path.parent, root_names=[HF_CONFIG_FILE])
    data = read_config_json(path)
    text = data if data.get("model_type") in tables else data.get("text_config")
    if not isinstance(text, dict) or text.get("model_type") not in tables:
        raise CheckpointError(f"{path}: no {model} text config (model_type {', '.join(tables)}) for "
                              f"{spec_flag(spec)}; point --load at a {model} checkpoint mmparity convert wrote")
    refuse_unusable_sizes(text, path)
    return config_view(text, tables), path


def _same(a, b) -> bool:
    return (list(a) == list(b)) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def checked_run_config(config, want, where, spec: tuple):
    """The run's config (Megatron-LM's flags) with what they cannot say (:data:`NOT_IN_FLAGS`)
    taken from ``want``, the config the HF file gives; what they can say (:data:`FLAGS`) checked
    against it, one line naming the flag and ``where`` (the file) where they differ."""
    for flag, field in FLAGS:
        got, expected = getattr(config, field), getattr(want, field)
        if not _same(got, expected):
            raise ValueError(f"{where}: {flag} gives {field}={got!r} where the HF config says {expected!r}; pass "
                             f"the flag as {where} says ({spec_flag(spec)})")
    return dataclasses.replace(config, **{field: getattr(want, field) for field in NOT_IN_FLAGS})
