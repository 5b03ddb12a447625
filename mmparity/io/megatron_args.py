"""What a converted mcore checkpoint tells Megatron-LM's loader about itself: its ``args`` and,
for torch_dist, its content metadata. Nothing about training it never had.

Megatron-LM's ``load_checkpoint`` reads an ``args`` Namespace from every checkpoint that has one
(legacy rank files and torch_dist's common state alike) and, unless ``--finetune``, runs
``check_checkpoint_args`` on it: ``num_layers``, ``hidden_size`` and ``num_attention_heads`` must
equal the run's, and for legacy files ``tensor_model_parallel_size`` and
``pipeline_model_parallel_size`` too (``add_position_embedding`` defaults to True when absent;
``max_position_embeddings``, ``make_vocab_size_divisible_by``, ``padded_vocab_size`` and
``tokenizer_type`` are compared only for runs with ``--vocab-file``). For torch_dist it reads
the TP/PP sizes (warning "TP size not found in checkpoint args, using 1" without them) and whether
the run that saved it kept RNG and optimizer state (``no_save_rng`` / ``no_save_optim``);
``--use-checkpoint-args`` (``load_args_from_checkpoint``) copies the model's description from it:
sizes, position embedding and RoPE base, biases, activation, norm, tying, and a MoE model's
experts and router. So we record that, with values read off the HF config and the converted
tensors, under Megatron-LM's argument names, and also what a model needs that its loader does
not restore (norm epsilon; multi-latent attention's ranks, head widths and YaRN; the router's
groups and dtype: docs/megatron.md), so the checkpoint says everything a run must be given; and
``no_save_optim`` / ``no_save_rng``: there is none. No iteration counters, no consumed samples,
no RNG, no optimizer.

A ``argparse.Namespace`` of plain values pickles as ``argparse.Namespace`` plus ints, floats,
strings and bools: what Megatron's ``safe_globals`` and mmparity's own allow-list
(``unpickle.OBJECT_NAMES`` / ``LEGACY_NAMES``) both accept.

Content metadata (``dist_checkpointing.save(..., content_metadata=...)``, stored in the common
state under ``content_metadata``) is what Megatron-LM's ``_build_sharded_state_dict_metadata``
gives for a run without a distributed optimizer: the flags that shape the sharded state dict's
keys. Ours were made with mcore's defaults, which these flags name; the distributed optimizer's
sharding type is left out because there is no optimizer state to be sharded.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from mmparity import config as hfconfig
from mmparity.io import unpickle
from mmparity.io.fsio.errors import CheckpointError
from mmparity.parallel import ep as ep_mod
from mmparity.parallel import pp as pp_mod
from mmparity.parallel.axes import Grid

__all__ = ["ARGS_KEY", "args_parallelism", "checkpoint_args", "content_metadata", "read_legacy_args"]

ARGS_KEY = "args"
# The embedding table whose rows are Megatron's padded vocabulary (``padded_vocab_size``).
_EMBEDDING_SUFFIX = "embedding.word_embeddings.weight"
# A MoE layer's router: the layer's global number.
_ROUTER_KEY = re.compile(r"^(?:.*\.)?decoder\.layers\.(\d+)\.mlp\.router\.weight$")


def content_metadata() -> dict:
    """The content metadata Megatron-LM records for a torch_dist save without a distributed
    optimizer (``_build_sharded_state_dict_metadata`` less its process group)."""
    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _model_config(cfg):
    """The config whose sizes Megatron's ``args`` describe: a whole VLM's language model (what
    Megatron-LM's ``--num-layers`` etc. size in LLaVA training), else the family's own."""
    return getattr(cfg, "text_config", None) or cfg


def checkpoint_args(cfg, shapes: Mapping[str, Sequence[int]], *, ckpt_format: str, grid: Grid,
                    vocab_multiple: int | None = None, declared: Mapping | None = None) -> argparse.Namespace:
    """The ``args`` subset Megatron-LM's loader reads, for a checkpoint of ``shapes`` (mcore key ->
    shape at TP 1, in plan order) converted from HF config ``cfg`` for a run on ``grid`` (TP x PP x EP).

    ``ckpt_format`` is Megatron-LM's name (``torch`` for legacy, ``torch_dist``). ``declared``: what
    the model's family says of its language model beyond the config's common facts (zero-centred
    norms, say), recorded where the checkpoint holds a language model."""
    if ckpt_format not in ("torch", "torch_dist"):
        raise ValueError(f"ckpt_format must be 'torch' or 'torch_dist', got {ckpt_format!r}")
    model = _model_config(cfg)
    tp, pp, ep = grid.sizes
    layout = pp_mod.pipeline_layout(list(shapes))
    heads = hfconfig.num_heads(model)
    groups = hfconfig.query_groups(model)
    fields: dict = {
        "num_layers": layout.num_layers or getattr(model, "num_hidden_layers", None),
        "hidden_size": model.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "group_query_attention": groups != heads,
        # A config that states its dense layers' width apart from its experts' (Llama 4's
        # intermediate_size_mlp; its intermediate_size is the experts') gives that one.
        "ffn_hidden_size": getattr(model, "intermediate_size_mlp", None) or getattr(model, "intermediate_size", None),
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "expert_model_parallel_size": ep,
        "ckpt_format": ckpt_format,
        # What this checkpoint does not hold, as Megatron-LM records it for a run saved with
        # --no-save-optim --no-save-rng: its loader then does not look for them.
        "no_save_optim": True,
        "no_save_rng": True,
    }
    if getattr(model, "kv_lora_rank", None) is None:  # multi-latent attention has no one head width
        fields["kv_channels"] = hfconfig.head_dim(model)
    embedding = next((k for k in shapes if k.endswith(_EMBEDDING_SUFFIX)), None)
    if embedding is not None:
        # As Megatron-LM pads it for the recorded TP (what --use-checkpoint-args builds the tables
        # with): a legacy table's rows; torch_dist stores TP 1's rows, which load into any.
        rows = int(shapes[embedding][0])
        vocab = getattr(model, "vocab_size", None)
        fields["padded_vocab_size"] = (max(rows, hfconfig.padded_vocab_size(vocab, vocab_multiple, tp))
                                       if isinstance(vocab, int) and vocab_multiple else rows)
        fields["max_position_embeddings"] = getattr(model, "max_position_embeddings", None)
        fields["untie_embeddings_and_output_weights"] = not hfconfig.tied_embeddings(cfg)
        if vocab_multiple is not None:
            fields["make_vocab_size_divisible_by"] = vocab_multiple
        fields.update(_decoder_fields(model, shapes))
    experts = ep_mod.expert_count(list(shapes))
    if experts:
        fields["num_experts"] = experts
        fields.update(_moe_fields(model, shapes))
    if embedding is not None:
        # Last: what the family declares wins over what the common facts suggest (a sigmoid router
        # without an expert bias, say).
        fields.update(declared or {})
    return argparse.Namespace(**{k: v for k, v in fields.items() if v is not None})


def _number(value: float) -> int | float:
    """An integral value as Megatron-LM's integer flags parse it (``--rotary-base 10000``)."""
    return int(value) if float(value).is_integer() else float(value)


def _decoder_fields(model, shapes: Mapping[str, Sequence[int]]) -> dict:
    """What a language model is beyond its sizes, under Megatron-LM's argument names: those its
    ``load_args_from_checkpoint`` restores (``--use-checkpoint-args``), and those it does not but
    the model needs all the same (norm epsilon, multi-latent attention's ranks and head widths,
    YaRN), so that the checkpoint says everything a run must be given (docs/megatron.md)."""
    rope = hfconfig.rope_parameters(model)
    fields: dict = {
        # --use-checkpoint-args forces these on a run: a rotated fraction left at 1.0 would rotate
        # every channel of a model that rotates a quarter (Qwen3.5).
        "position_embedding_type": "rope", "rotary_base": _number(rope["rope_theta"]),
        "rotary_percent": float(rope.get("partial_rotary_factor", 1.0) or 1.0),
        "normalization": "RMSNorm", "layernorm_epsilon": getattr(model, "rms_norm_eps", None),
        "squared_relu": False,
        "swiglu": getattr(model, "hidden_act", None) in ("silu", "swish"),
        "attention_dropout": float(getattr(model, "attention_dropout", 0.0) or 0.0), "hidden_dropout": 0.0,
    }
    if getattr(model, "kv_lora_rank", None) is None:
        qkv_bias, linear_bias = hfconfig.decoder_biases(model)
        # What the tensors hold decides, where the config has no switch for it: Qwen2.5-VL's text
        # config (model type ``qwen2_5_vl_text``) names no q/k/v bias, yet its attention has them.
        # Qwen3's per-head q/k norms likewise are there where the keys hold them.
        qkv_bias = qkv_bias or any(k.endswith("self_attention.linear_qkv.bias") for k in shapes)
        linear_bias = linear_bias or any(k.endswith("self_attention.linear_proj.bias") for k in shapes)
        fields.update(add_qkv_bias=qkv_bias, add_bias_linear=linear_bias, rotary_interleaved=False,
                      qk_layernorm=any(k.endswith("self_attention.q_layernorm.weight") for k in shapes))
        fields.update(_hybrid_fields(model, shapes))
        return fields
    # Multi-latent attention (DeepSeek-V3): no biases, q/kv up-projection norms, interleaved rope
    # dimensions (mcore's MLA reads them so), YaRN as the release has it.
    fields.update(
        multi_latent_attention=True, q_lora_rank=getattr(model, "q_lora_rank", None),
        kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim, qk_layernorm=True,
        add_qkv_bias=False, add_bias_linear=False,
        rope_type="yarn" if rope["rope_type"] == "yarn" else "rope")
    if rope["rope_type"] == "yarn":
        fields.update(
            rotary_scaling_factor=float(rope["factor"]), mscale=float(rope.get("mscale", 1.0)),
            mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
            # Megatron-LM's names for these (its GPT YaRN flags); its MLA never reads them.
            yarn_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            yarn_beta_fast=float(rope.get("beta_fast", 32.0)), yarn_beta_slow=float(rope.get("beta_slow", 1.0)))
    return fields


def _hybrid_fields(model, shapes: Mapping[str, Sequence[int]]) -> dict:
    """A hybrid decoder's linear-attention layers (Qwen3.5's Gated DeltaNet) under Megatron-LM's
    names, which are the HF config's own for the sizes; and an attention output gate, read off
    the fused q/k/v rows (queries twice over: their values and their gates)."""
    fields: dict = {}
    qkv = next((s for k, s in shapes.items() if k.endswith("self_attention.linear_qkv.weight")), None)
    head = getattr(model, "head_dim", None)
    if qkv is not None and isinstance(head, int):
        heads, groups = hfconfig.num_heads(model), hfconfig.query_groups(model)
        if int(qkv[0]) == (2 * heads + 2 * groups) * head:
            fields["attention_output_gate"] = True
    kinds = list(getattr(model, "layer_types", None) or ())
    if "linear_attention" in kinds:
        fields.update(experimental_attention_variant="gated_delta_net",
                      linear_attention_freq=[int(kind == "linear_attention") for kind in kinds],
                      **{name: getattr(model, name) for name in (
                          "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                          "linear_num_key_heads", "linear_num_value_heads") if hasattr(model, name)})
    return fields


# An expert's and the shared expert's output linear ``[H, width]``, where a config names no width
# of its own for them (Llama 4's experts and shared expert are ``intermediate_size`` wide).
_EXPERT_FC2 = re.compile(r"mlp\.experts\.(linear_fc2\.weight\d+|local_experts\.\d+\.linear_fc2\.weight)$")
_SHARED_FC2 = re.compile(r"mlp\.shared_experts\.linear_fc2\.weight$")


def _width(shapes: Mapping[str, Sequence[int]], pattern) -> int | None:
    return next((int(shape[1]) for key, shape in shapes.items() if pattern.search(key) and len(shape) == 2), None)


def _moe_fields(model, shapes: Mapping[str, Sequence[int]]) -> dict:
    """A MoE language model's experts and router under Megatron-LM's argument names: DeepSeek-V3's
    (sigmoid scores with a score-correction bias, group-limited top-k) or a softmax top-k router's
    (Qwen3-MoE's: no bias). Which layers are MoE layers is read off the keys (a layer with a
    router), so that any set of them (``mlp_only_layers``, a sparse step) is said as it is."""
    routed = {int(m.group(1)) for k in shapes for m in [_ROUTER_KEY.match(k)] if m}
    moe = routed or set(hfconfig.moe_layer_range(model))
    groups = int(getattr(model, "n_group", None) or 1)
    layout = ep_mod.expert_key_layout(list(shapes))
    expert_bias = any(k.endswith("mlp.router.expert_bias") for k in shapes)
    return {
        "moe_ffn_hidden_size": getattr(model, "moe_intermediate_size", None) or _width(shapes, _EXPERT_FC2),
        "moe_shared_expert_intermediate_size": (hfconfig.shared_expert_size(model)
                                                or _width(shapes, _SHARED_FC2)),
        "moe_shared_expert_gate": any(k.endswith("mlp.shared_experts.gate_weight") for k in shapes) or None,
        "moe_layer_freq": [int(i in moe) for i in range(model.num_hidden_layers)],
        "moe_router_topk": getattr(model, "num_experts_per_tok", None) or getattr(model, "top_k_experts", None),
        # DeepSeek-V3's config names no scoring function: its router is the one with a bias.
        "moe_router_score_function": getattr(model, "scoring_func", None) or ("sigmoid" if expert_bias else "softmax"),
        "moe_router_enable_expert_bias": expert_bias,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": int(model.topk_group) if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(getattr(model, "routed_scaling_factor", 1.0) or 1.0),
        "moe_router_pre_softmax": False,
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": layout == ep_mod.GROUPED if layout is not None else None,
    }


def read_legacy_args(path: str | os.PathLike) -> argparse.Namespace | None:
    """The ``args`` of one legacy rank file (None when it has none), decoded by the allow-list
    unpickler, Megatron's own classes in it (its enums) as inert records; tensors are mapped, not
    read."""
    import torch

    path = Path(path)
    restricted = unpickle.torch_pickle_module(unpickle.LEGACY_NAMES, str(path), unpickle.MEGATRON_INERT_MODULES)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False, mmap=True, pickle_module=restricted)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable as a torch.save file ({type(exc).__name__})") from None
    args = payload.get(ARGS_KEY) if isinstance(payload, dict) else None
    if args is not None and not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{path}: 'args' is a {type(args).__name__}, not an argparse.Namespace")
    return args


def _int_arg(args, name: str) -> int | None:
    value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def args_parallelism(args) -> dict[str, int]:
    """The TP / PP / EP / virtual-PP sizes Megatron-LM's ``args`` records (those it records)."""
    if args is None:
        return {}
    sizes = {"tp": _int_arg(args, "tensor_model_parallel_size"), "pp": _int_arg(args, "pipeline_model_parallel_size"),
             "ep": _int_arg(args, "expert_model_parallel_size"),
             "vpp": _int_arg(args, "virtual_pipeline_model_parallel_size")}
    return {k: v for k, v in sizes.items() if v is not None}
