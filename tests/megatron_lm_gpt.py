"""Megatron-LM main's ``pretrain_gpt.py`` path on the CPU, for ``tests/megatron/test_megatron_lm_gpt.py``.

A whole VLM's language model trained alone, as a user of Megatron-LM trains Kimi-K2.5's or
Mistral3's (its ``LLaVAModel`` builds neither tower): the flags parsed and validated by
Megatron-LM's own ``parse_args`` / ``validate_args`` (with ``load_args_from_checkpoint`` under
``--use-checkpoint-args``), the globals set by its ``set_global_variables`` (the tokenizer pads
the vocabulary), the model built by its ``model_provider`` with ``gpt_builders.gpt_builder``
through its ``get_model``, loaded and saved by ``megatron.training.checkpointing``'s
``load_checkpoint`` / ``save_checkpoint``, the optimizer made by megatron-core's
``get_megatron_optimizer`` over Megatron's ``DistributedDataParallel`` where a distributed
optimizer is asked for, and a checkpoint converted to the other format as ``--ckpt-convert-format``
does it (``setup_model_and_optimizer``'s conversion branch: load, then save with the other
format).

Everything that is a CPU stand-in lives here, in the harness, never in mmparity:

* Transformer Engine: ``gpt_builders``' spec functions asked for TE go through
  ``te_stand_ins.megatron_te_spec`` (Megatron's own spec, the CPU stand-ins in TE's places), the
  build through ``buildable_without_te`` / ``host_placement`` as mmparity's own builders do;
* CUDA: the RNG state, device fences, ``current_device``, the tracker's CUDA tensor
  (``tests.megatron.test_megatron_lm_loop._cpu_stand_ins``), the streams ``get_model`` wraps DDP in;
* the optimizer's parameter and gradient type checks (``type() == 'torch.cuda.FloatTensor'``),
  answered for CPU float32 tensors while it is built and stepped (Megatron's distributed
  optimizer refuses CPU parameters by this check alone), and the flags and norms its classes make
  on ``cuda`` (made on the CPU).

``gpt_builders.py`` and ``model_provider.py`` sit at the root of a Megatron-LM checkout: they are
imported from ``MEGATRON_LM`` (the checkout) unless importable already.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

ITERATION = 5
TEXT_ROWS, TEXT_LENGTH = 2, 17


def skip_reason() -> str | None:
    """Why the Megatron-LM GPT tests cannot run here (None: they can)."""
    if sys.version_info < (3, 12):
        return "Megatron-LM main's training code needs Python >= 3.12 (typing.override)"
    try:
        found = importlib.util.find_spec("megatron.training.checkpointing") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return ("needs Megatron-LM main's megatron.training on PYTHONPATH (no release has it; CI cannot "
                "fetch it)")
    missing = [name for name in ("gpt_builders", "model_provider") if _root_module_path(name) is None]
    if missing:
        return (f"needs Megatron-LM main's {', '.join(m + '.py' for m in missing)}: set MEGATRON_LM to the "
                "checkout (or put its root on PYTHONPATH)")
    return None


def _root_module_path(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        return Path(spec.origin)
    checkout = os.environ.get("MEGATRON_LM")
    if checkout and (Path(checkout) / f"{name}.py").is_file():
        return Path(checkout) / f"{name}.py"
    return None


def _root_module(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _root_module_path(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------
# flags


def _number(value) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def model_flags(cfg) -> list[str]:
    """The flags a Megatron-LM user trains the whole VLM ``cfg``'s language model with
    (``pretrain_gpt.py``), read off its HF text config: DeepSeek-V3 (Kimi-K2.5) or a Mistral /
    Llama decoder."""
    text = cfg.text_config
    flags = ["--num-layers", str(text.num_hidden_layers), "--hidden-size", str(text.hidden_size),
             "--ffn-hidden-size", str(text.intermediate_size), "--num-attention-heads", str(text.num_attention_heads),
             "--max-position-embeddings", str(text.max_position_embeddings),
             "--position-embedding-type", "rope", "--normalization", "RMSNorm",
             "--norm-epsilon", repr(float(text.rms_norm_eps)), "--swiglu", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0"]
    rope = dict(text.rope_parameters)
    flags += ["--rotary-base", _number(rope["rope_theta"])]
    if text.model_type != "deepseek_v3":
        return flags + ["--group-query-attention", "--num-query-groups", str(text.num_key_value_heads),
                        "--kv-channels", str(getattr(text, "head_dim", None)  # Qwen2 has no head_dim field
                                             or text.hidden_size // text.num_attention_heads)]
    flags += ["--multi-latent-attention", "--q-lora-rank", str(text.q_lora_rank),
              "--kv-lora-rank", str(text.kv_lora_rank), "--qk-head-dim", str(text.qk_nope_head_dim),
              "--qk-pos-emb-head-dim", str(text.qk_rope_head_dim), "--v-head-dim", str(text.v_head_dim),
              "--qk-layernorm", "--rope-type", rope["rope_type"]]
    if rope["rope_type"] == "yarn":
        # What the command line has for YaRN. Megatron-LM's --yarn-original-max-position-embeddings /
        # --yarn-beta-fast / --yarn-beta-slow reach only non-MLA YaRN (docs/megatron.md).
        flags += ["--rotary-scaling-factor", _number(rope["factor"]), "--mscale", _number(rope["mscale"]),
                  "--mscale-all-dim", _number(rope["mscale_all_dim"])]
    dense = int(text.first_k_dense_replace)
    flags += ["--num-experts", str(text.n_routed_experts),
              "--moe-layer-freq", f"[0]*{dense}+[1]*{text.num_hidden_layers - dense}",
              "--moe-ffn-hidden-size", str(text.moe_intermediate_size),
              "--moe-shared-expert-intermediate-size", str(text.moe_intermediate_size * text.n_shared_experts),
              "--moe-router-topk", str(text.num_experts_per_tok), "--moe-router-score-function", "sigmoid",
              "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", _number(text.routed_scaling_factor),
              "--moe-router-dtype", "fp32", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather",
              "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"]
    if int(text.n_group) > 1:
        flags += ["--moe-router-num-groups", str(text.n_group), "--moe-router-group-topk", str(text.topk_group)]
    return flags


# What Megatron-LM's ``load_args_from_checkpoint`` does not restore, although the model needs it:
# a --use-checkpoint-args run must still pass these (docs/megatron.md, upstream findings).
NOT_RESTORED = ("--norm-epsilon", "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                "--qk-pos-emb-head-dim", "--v-head-dim", "--qk-layernorm", "--rope-type", "--rotary-scaling-factor",
                "--mscale", "--mscale-all-dim", "--moe-router-num-groups", "--moe-router-group-topk",
                "--moe-router-dtype")
# Flags that take no value.
_SWITCHES = {"--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--group-query-attention",
             "--multi-latent-attention", "--qk-layernorm", "--moe-router-enable-expert-bias", "--moe-grouped-gemm"}


def only(flags: list[str], names) -> list[str]:
    """The flags of ``flags`` named in ``names``, with their values."""
    out, i = [], 0
    while i < len(flags):
        takes = 0 if flags[i] in _SWITCHES else 1
        if flags[i] in names:
            out += flags[i:i + 1 + takes]
        i += 1 + takes
    return out


def run_flags(*, tp: int, pp: int, ep: int, fmt: str, load: str, save: str, vocab: int) -> list[str]:
    """What a run says beside the model: sizes of the job, data, tokenizer, checkpoints; CPU ones."""
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--expert-model-parallel-size", str(ep), "--seq-length", str(TEXT_LENGTH), "--micro-batch-size", "1",
            "--lr", "1e-4", "--train-iters", "10", "--save-interval", "5", "--vocab-size", str(vocab),
            "--tokenizer-type", "NullTokenizer", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
            "--no-persist-layer-norm", "--transformer-impl", "transformer_engine",
            "--ckpt-format", "torch" if fmt == "legacy" else "torch_dist", "--load", load, "--save", save]


def megatron_lm_args(argv: list[str]):
    """Megatron-LM's ``parse_and_validate_args`` on ``argv`` (``--use-checkpoint-args`` included),
    then ``set_global_variables`` (the tokenizer pads the vocabulary)."""
    from megatron.training import arguments
    from megatron.training.global_vars import set_global_variables

    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    try:
        args = arguments.parse_args()
        if args.use_checkpoint_args:
            from megatron.training.checkpointing import load_args_from_checkpoint

            load_args_from_checkpoint(args)
        arguments.validate_args(args)
    finally:
        sys.argv = saved
    args.save_tokenizer_assets = False  # the release's tokenizer files; --base copies them on export
    set_global_variables(args)
    return args


# --------------------------------------------------------------------------------------------------
# CPU stand-ins (harness only)


class _Stream:
    """A CUDA stream's interface, doing nothing: the CPU has one stream of work."""

    def wait_stream(self, *unused) -> None:
        return None


@contextlib.contextmanager
def _cpu_streams():
    saved = torch.cuda.Stream, torch.cuda.stream, torch.cuda.current_stream
    torch.cuda.Stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.stream, torch.cuda.current_stream = saved


class _HostTorch:
    """``torch`` as a Megatron module sees it on a CPU-only machine: tensors it makes on ``cuda``
    (the optimizer's loss-scale and overflow flags, norms it reduces) are made on the CPU, where
    gloo reduces them; everything else is torch itself."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        value = getattr(self._torch, name)
        if name not in self._FACTORIES:
            return value

        def on_host(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return value(*args, device=device, **kwargs)

        return on_host


def _host_torch_in(*module_names: str) -> None:
    for name in module_names:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _HostTorch):
            module.torch = _HostTorch(torch)


@contextlib.contextmanager
def _cpu_float_parameters_pass_as_cuda():
    """Megatron's optimizers keep fp32 parameters (and clip fp32 gradients) whose ``type()`` is
    ``torch.cuda.FloatTensor`` and refuse any other: for the CPU's float32 ones, say so while
    one is built and stepped (the tensors are otherwise used as they are)."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        return "torch.cuda.FloatTensor" if not args and not kwargs and name == "torch.FloatTensor" else name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def _te_version_passes():
    from megatron.core.extensions import transformer_engine_spec_provider as provider

    from mmparity.models.core import te_stand_ins

    saved = provider.is_te_min_version
    if not te_stand_ins.HAVE_TE:
        provider.is_te_min_version = lambda *unused, **unused_kw: True
    try:
        yield
    finally:
        provider.is_te_min_version = saved


@contextlib.contextmanager
def _te_specs(gpt_builders):
    """``gpt_builders``' TE spec functions through the stand-ins (Megatron's own spec), the
    hybrid (experimental attention variant) block spec included."""
    from mmparity.models.core import te_stand_ins
    from mmparity.models.parts.qwen3_5_text.megatron import hybrid_spec_without_te

    names = ("get_gpt_decoder_block_spec", "get_gpt_layer_with_transformer_engine_spec")
    hybrid = "get_transformer_block_with_experimental_attention_variant_spec"
    saved = {name: getattr(gpt_builders, name) for name in names + (hybrid,)}

    def through(original):
        def spec(*a, **k):
            # The provider picks the q/k norms' class (--qk-layernorm) by TE's version, which it
            # cannot read without TE: the stand-in TENorm, as TE >= 1.9 gives.
            with _te_version_passes():
                return te_stand_ins.megatron_te_spec(original, *a, **k)
        return spec

    def hybrid_through(original):
        def spec(*a, **k):
            with hybrid_spec_without_te():
                return te_stand_ins.megatron_te_spec(original, *a, **k)
        return spec

    for name in names:
        setattr(gpt_builders, name, through(saved[name]))
    setattr(gpt_builders, hybrid, hybrid_through(saved[hybrid]))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(gpt_builders, name, original)


def build_gpt(args, ddp: bool) -> list:
    """Megatron-LM's ``get_model(model_provider(gpt_builder))`` for this rank: the model chunks,
    wrapped in Megatron's DDP when ``ddp`` (what a distributed optimizer needs)."""
    from megatron.core.enums import ModelType
    from megatron.core.extensions import transformer_engine_spec_provider
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_latent_attention, transformer_block
    from megatron.training.training import get_model

    from mmparity.models.core.mla_moe import host_placement
    from mmparity.models.core.te_stand_ins import buildable_without_te

    gpt_builders = _root_module("gpt_builders")
    provider = _root_module("model_provider")
    builder = lambda *a, **k: provider.model_provider(gpt_builders.gpt_builder, *a, **k)  # noqa: E731
    with _te_specs(gpt_builders), buildable_without_te(gpt_model, multi_latent_attention, transformer_block,
                                                       transformer_engine_spec_provider), \
            host_placement("cpu"), _cpu_streams():
        return get_model(builder, ModelType.encoder_or_decoder, wrap_with_ddp=ddp)


def megatron_optimizer(model_chunks: list, distributed: bool):
    """megatron-core's ``get_megatron_optimizer`` (Adam, lr 0: its state after a step, the
    weights unchanged) as Megatron-LM's ``setup_model_and_optimizer`` makes it."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _host_torch_in("megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
                   "megatron.core.optimizer.clip_grads", "megatron.core.utils")
    config = OptimizerConfig(optimizer="adam", lr=0.0, min_lr=0.0, weight_decay=0.0,
                             use_distributed_optimizer=distributed, params_dtype=torch.float32)
    with _cpu_float_parameters_pass_as_cuda():
        # The harness's process groups are gloo already; no second set (--disable-gloo-process-groups).
        optimizer = get_megatron_optimizer(config, model_chunks, use_gloo_process_groups=False)
        for chunk in model_chunks:
            for p in chunk.parameters():
                grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(p.shape) + p.numel()))
                if hasattr(p, "main_grad"):
                    p.main_grad.copy_(grad)
                else:
                    p.grad = grad
        optimizer.step()
        optimizer.zero_grad()
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        # Its legacy-format state (distrib_optim.pt) is gathered over a gloo group: on the CPU the
        # data-parallel group is one.
        if getattr(inner, "data_parallel_group_gloo", False) is None:
            inner.data_parallel_group_gloo = inner.data_parallel_group
    return optimizer


# --------------------------------------------------------------------------------------------------
# the ranks


def _unwrap(chunk):
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _logits(model, ids: torch.Tensor, vocab: int):
    """``GPTModel``'s logits over the real vocabulary on ``ids`` (the last stage's; None on
    others), its pipeline stages linked as mcore's forward schedule links them."""
    from mmparity.models.core.pipeline import StageLink
    from mmparity.models.core.te_stand_ins import cuda_calls_on_host

    positions = torch.arange(ids.shape[1]).expand_as(ids)
    training = model.training
    model.eval()  # an evaluation pass (MoE under TP refuses a training pass without sequence parallelism)
    try:
        with torch.no_grad(), StageLink(model, model), cuda_calls_on_host():
            logits = model(ids, positions, None, runtime_gather_output=True)
    finally:
        model.train(training)
    return logits[..., :vocab].float().clone() if model.post_process else None


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def hf_logits(release: str, family: str, ids: torch.Tensor) -> torch.Tensor:
    """HF's own logits for ``ids``: the release read by transformers' ``from_pretrained`` into the
    family's reference class, its text model and head (``model.model.language_model``,
    ``lm_head``), the decoder a whole VLM runs on text."""
    from mmparity.models import registry as families
    from mmparity.convert.configs import read_hf_config

    from mmparity.models.spec import Case

    cfg = read_hf_config(release, for_models=True)[0]
    reference = type(families.get(family).build_reference(cfg))
    model = reference.from_pretrained(release, dtype=torch.float32).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # HF's per-expert loop, its definition
    classes = families.get(family).hooks.megatron
    gpt = classes.get("GPTModel") if hasattr(classes, "get") else None
    with torch.no_grad():
        if gpt is not None and gpt.reference_run is not None:
            # The family's own HF run of its language model, as its GPTModel computes by design
            # (Llama 4's text model sits elsewhere; Gemma 3's runs unscaled, on one RoPE).
            case = Case("text", {"input_ids": ids, "loss_mask": torch.ones(ids.shape)}, ("logits",))
            return gpt.reference_run(model, case, cfg)["logits"].view(*ids.shape, -1)
        hidden = model.model.language_model(input_ids=ids).last_hidden_state
        return model.lm_head(hidden).float()


def _rank_file_state(converted: str) -> dict:
    """This rank's tensors in a legacy checkpoint at the run's grid (TE's ``_extra_state`` left out)."""
    from megatron.core import parallel_state as ps

    from mmparity.io.legacy import open_legacy

    ep = ps.get_expert_model_parallel_rank() if ps.get_expert_model_parallel_world_size() > 1 else 0
    state = open_legacy(converted).load_rank(ps.get_tensor_model_parallel_rank(),
                                             ps.get_pipeline_model_parallel_rank(), ep)
    return {k: v for k, v in state.items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _trained_rank_state(trained: str, model) -> dict:
    """This rank's file of the changed weights' conversion (what training made of them)."""
    from megatron.core import parallel_state as ps

    from mmparity.io.legacy import open_legacy

    ep = ps.get_expert_model_parallel_rank() if ps.get_expert_model_parallel_world_size() > 1 else 0
    state = open_legacy(trained).load_rank(ps.get_tensor_model_parallel_rank(),
                                           ps.get_pipeline_model_parallel_rank(), ep)
    own = model.state_dict()
    return {k: state.get(k, own[k]) for k in own}


def gpt_rank(rank: int, world: int, params: dict) -> dict:
    """One rank of a Megatron-LM GPT run: build from flags, ``load_checkpoint`` strictly, logits
    against mmparity's own loader of the same checkpoint; then, where asked, the weights changed
    as training changes them, an optimizer stepped, ``save_checkpoint``, and that checkpoint
    loaded back and saved in the other format as ``--ckpt-convert-format`` does."""
    from megatron.training import checkpointing
    from megatron.training.utils.common_utils import update_use_dist_ckpt

    from mmparity.parallel import runtime
    from mmparity.parallel.axes import Grid
    from mmparity.megatron import load as megatron_load
    from tests.megatron.test_megatron_lm_loop import _cpu_stand_ins

    _cpu_stand_ins()
    # Its argument check reads the GPU's compute capability for grouped GEMM experts.
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    job = None
    if params.get("reference") is not False:
        # mmparity's own strict loader (verify --load's) of the same weights at the run's grid: the
        # checkpoint itself, or its legacy twin at that grid (``reference``: mmparity loads
        # torch_dist experts only at EP 1).
        job = megatron_load.load_job(params.get("reference") or params["load"], tp=params["tp"],
                                     pp=params["pp"])[0]
    # The checkpoint's own split of the stack (the longer stages first), as mmparity's loader builds it.
    runtime.init_parallel(Grid.of(params["tp"], params["pp"], params["ep"]),
                          layer_counts=job.layer_counts if job is not None else None)
    args = megatron_lm_args(params["argv"])
    # Megatron-LM trains the model wrapped in its DDP (gradient buffers the optimizer reads).
    distributed = params.get("optimizer") == "distributed"
    chunks = build_gpt(args, ddp=params.get("optimizer") is not None)
    model = _unwrap(chunks[0])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # whatever the load leaves unset shows
    result: dict = {"rank": rank}
    # Megatron-LM's legacy loader answers a failed strict load by loading non-strictly and printing
    # what that returned ("load_return: ..."): recorded, so a test can tell.
    said = []
    checkpointing.print = lambda *a, **k: said.append(" ".join(map(str, a)))
    try:
        iteration, _ = checkpointing.load_checkpoint(chunks, None, None, strict=True)
    except BaseException as exc:  # noqa: BLE001 - reported: what Megatron-LM said (a test may expect it)
        result["load_error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
        return result
    result["iteration"] = iteration
    result["strict_failed"] = [line for line in said if line.startswith("load_return")]
    # ``length``: rows no longer than the family's class computes HF's function on (Llama 4's).
    ids = torch.randint(0, params["vocab"], (TEXT_ROWS, params.get("length") or TEXT_LENGTH),
                        generator=torch.Generator().manual_seed(3))
    # ``forward`` False: a model whose forward cannot run on the CPU (its kernels are GPU-only) is
    # loaded, trained and saved without one; its tensors are compared instead.
    forward = params.get("forward", True)
    logits = _logits(model, ids, params["vocab"]) if forward else None
    if job is None and params.get("expected"):
        # This rank's file of a legacy conversion at the run's grid: what the load must give.
        want = _rank_file_state(params["expected"])
        own = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
        result["unequal"] = sorted(set(want) ^ set(own) | {k for k in want.keys() & own.keys()
                                                           if not torch.equal(own[k], want[k])})[:8]
        result["only_file"], result["only_model"] = sorted(set(want) - set(own))[:4], sorted(set(own) - set(want))[:4]
        result["tensors"] = len(want)
    if job is not None:
        reference = megatron_load.build_and_load(rank, world, job)
        want = _logits(reference, ids, params["vocab"]) if forward else None
        if logits is not None:
            result["rel_l2"] = _rel_l2(logits, want)
            result["equal"] = bool(torch.equal(logits, want))
        # Every tensor as mmparity's strict loader reads it (Megatron-LM's legacy loader retries a
        # failed strict load non-strictly and goes on: only the values tell).
        own, wanted = model.state_dict(), reference.state_dict()
        result["unequal"] = sorted(k for k, v in wanted.items() if torch.is_tensor(v) and not k.endswith("_extra_state")
                                   and not (k in own and torch.equal(own[k], v)))[:8]
        result["tensors"] = sum(torch.is_tensor(v) and not k.endswith("_extra_state") for k, v in wanted.items())
    if params.get("hf") and logits is not None:
        result["hf_rel_l2"] = _rel_l2(logits, hf_logits(params["hf"], params["family"], ids))
    if params.get("save") is None:
        return result
    # Training: the weights of the changed release (its conversion for this rank), loaded as an
    # optimizer step would have left them.
    trained = _trained_rank_state(params["trained"], model)
    megatron_load.load_state_dict_strictly(model, trained)
    optimizer = megatron_optimizer(chunks, distributed) if params.get("optimizer") else None
    # Its step at lr 0 leaves every weight as it was.
    own = model.state_dict()
    result["moved_by_optimizer"] = sorted(k for k, v in trained.items() if torch.is_tensor(v)
                                          and not torch.equal(own[k], v))[:8]
    checkpointing.save_checkpoint(ITERATION, chunks, optimizer, None, 0)
    if params.get("convert_to"):
        # --ckpt-convert-format: setup_model_and_optimizer loads, then saves in the other format.
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        args.load, args.no_load_optim, args.no_load_rng = args.save, optimizer is None, True
        args.finetune = False
        # Without no_grad Megatron-LM's distributed optimizer cannot take back the fp32 parameters
        # it saved (its main parameters are views of them): docs/megatron.md, upstream findings.
        with torch.no_grad() if distributed else contextlib.nullcontext():
            iteration, _ = checkpointing.load_checkpoint(chunks, optimizer, None, strict=True)
        args.ckpt_format = params["convert_to"]
        args.save = os.path.join(params["convert_save"], params["convert_to"])
        update_use_dist_ckpt(args)
        checkpointing.save_checkpoint(iteration, chunks, optimizer, None, 0)
        result["converted_iteration"] = iteration
    return result

