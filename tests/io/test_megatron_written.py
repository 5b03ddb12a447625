"""Back out of training: checkpoints Megatron's own savers wrote, converted to HF with ``--base``.

The loop, with stock megatron-core only (no Megatron-LM training code): an HF tiny model is
converted by mmparity and loaded strictly into Megatron's classes (``megatron_load``, as ``verify
--load`` builds them); its weights are then changed ("trained": the conversion of a seeded,
perturbed copy of the HF model, loaded strictly into the same classes); the model is saved

- with ``megatron.core.dist_checkpointing.save``, together with a megatron-core optimizer's
  sharded state (``FP32Optimizer`` over torch Adam after one step, ``lr=0`` so the weights stay
  what they were set to) and an RNG ``ShardedObject``, as Megatron-LM's ``save_checkpoint`` lays
  out a torch_dist iteration;
- as legacy per-rank files shaped as Megatron-LM's ``save_checkpoint`` writes them
  (``args`` Namespace with Megatron enums and dtypes inside, ``checkpoint_version`` 3.0,
  ``iteration``, ``model``, ``optimizer``, ``opt_param_scheduler``, ``rng_state`` with numpy,
  torch and Python RNG states; tracker ``latest_checkpointed_iteration.txt``, ``iter_0000007``).

Neither has mmparity's files (manifest, HF config, side file). ``convert --to hf --base ORIGINAL``
must then give the perturbed HF weights bit-exactly, and the tensors Megatron has no place for
(CLIP's ``ln_post``, tower layers past ``vision_feature_layer``) equal to the base's, listed as
such. Parts Megatron-core cannot build here (the Pixtral / MoonViT towers of ``mistral3``,
``pixtral_12b``, ``kimi_k25_vl`` need Megatron-LM main) are saved beside the built parts from the
changed conversion, under the same keys Megatron-LM's class would give them.

The CPU stand-ins (an FP32Optimizer without its CUDA loss-scale tensor, a CPU "cuda" RNG state)
live here, in the harness, never in mmparity.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.models.core.inputs import random_like_state
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from tests.cli.test_convert_cli import run_cli
from tests.megatron.test_megatron_load import llava_clip_config

FAST = ["llava", "clip"]
WHOLE = ["mistral3", "pixtral_12b", "kimi_k25_vl"]
ITERATION = 7


def save_hf_state(family: str, path: Path, state: dict, cfg) -> Path:
    """An HF directory of the family's reference class holding ``state``."""
    from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint

    fam = families.get(family)
    model = fam.build_reference(cfg)
    model.load_state_dict(state)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(path)
    else:
        save_safetensors_checkpoint(path, model.state_dict(), extra_files={"config.json": cfg.to_json_string()})
    return path


def make_pair(family: str, tmp: Path, cfg=None) -> tuple[Path, Path]:
    """(base, trained): the HF release (of ``cfg``, else the family's tiny config), and a seeded
    perturbation of every one of its tensors."""
    fam = families.get(family)
    # LLaVA on the CLIP tower: stock megatron-core's LLaVAModel builds CLIP-like towers only.
    if cfg is None:
        cfg = llava_clip_config() if family == "llava" else fam.tiny_config()
    ref = fam.build_reference(cfg)
    base_state = random_like_state(ref.state_dict(), seed=3)
    generator = torch.Generator().manual_seed(11)
    trained = {}
    for key, value in base_state.items():
        if value.is_floating_point():
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float32).to(value.dtype)
            trained[key] = value + 0.125 * noise
        else:
            trained[key] = value.clone()
    base = save_hf_state(family, tmp / "base", base_state, cfg)
    (base / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))
    (base / "preprocessor_config.json").write_text(json.dumps({"size": 16}))
    return base, save_hf_state(family, tmp / "trained", trained, cfg)


def megatron_args(tp: int, pp: int = 1, ep: int = 1) -> argparse.Namespace:
    """A Megatron-LM ``args`` Namespace, with what its real one holds inside: enums, dtypes, lists."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=None, params_dtype=torch.float32, attention_backend=AttnBackend.auto,
        ckpt_format="torch", make_vocab_size_divisible_by=128, iteration=ITERATION, lr=1e-4, seed=1234,
        recompute_modules=["core_attn"], exit_signal=signal.SIGTERM, no_save_rng=False, no_save_optim=False, data_parallel_random_init=False)


def rng_state() -> list:
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),  # CPU stand-in
             "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]


def cpu_fp32_optimizer(model: torch.nn.Module, params=None):
    """megatron-core's FP32Optimizer over torch Adam after one step (``lr=0``: state, not new
    weights), over ``params`` (default: all the model's). Its constructor makes a CUDA loss-scale
    tensor; the CPU stand-in sets it here."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    adam = torch.optim.Adam(params, lr=0.0)
    optimizer = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(optimizer, adam, OptimizerConfig(optimizer="adam", lr=0.0), lambda *a: None)
    optimizer._scale, optimizer.is_stub_optimizer = torch.tensor([1.0]), False
    generator = torch.Generator().manual_seed(5)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
    adam.step()
    for p in params:
        p.grad = None
    return optimizer


@contextlib.contextmanager
def cpu_stand_ins():
    """megatron-core's torch_dist save syncs the CUDA device and keeps its error flag there: on a
    CPU build, a no-op sync and the CPU stand in (harness only)."""
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _replicated(key: str, tensor: torch.Tensor, tp_rank: int):
    from megatron.core.dist_checkpointing import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, tensor.contiguous(), replica_id=(0, tp_rank, 0))


def chained_cpu_optimizer(model: torch.nn.Module):
    """Megatron-LM's optimizer for a MoE model under expert parallelism: a ``ChainedOptimizer`` of
    one for the dense parameters and one for the experts, whose torch_dist state it saves under
    ``chained_0.`` / ``chained_1.``."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    named = list(model.named_parameters())
    experts = [p for name, p in named if ".experts." in name]
    assert experts, "a model with experts"
    return ChainedOptimizer([cpu_fp32_optimizer(model, [p for name, p in named if ".experts." not in name]),
                             cpu_fp32_optimizer(model, experts)])


def _save_rank(rank: int, world: int, base_mcore: str, trained_mcore: str, trained_tp1: str, out: str, fmt: str,
               iteration: int, chained: bool = False):
    """One rank: Megatron's classes loaded with the base's conversion, changed to the trained
    conversion (strictly), saved as Megatron-LM would save iteration ``iteration`` in ``fmt``
    (``chained``: with a chained optimizer, dense and expert parameters apart)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject

    from mmparity.megatron import load as megatron_load
    from mmparity.io.legacy import open_legacy

    job, _family, _name, _world = megatron_load.load_job(base_mcore)
    job.init_parallel()
    model, _loaded, _not_loaded, _filled = megatron_load._load(rank, job)
    tp_rank = rank % job.grid.tp.size
    trained_rank = open_legacy(trained_mcore).load_rank(tp_rank)
    own = model.state_dict()
    # "Training": the changed weights, loaded strictly into the same classes.
    megatron_load.load_state_dict_strictly(model, {k: trained_rank.get(k, own[k]) for k in own})
    # What the classes built here do not hold (towers only Megatron-LM main builds).
    beside = {k: v for k, v in trained_rank.items() if k not in own and isinstance(v, torch.Tensor)}
    iteration_dir = Path(out) / f"iter_{iteration:07d}"
    args = megatron_args(job.grid.tp.size)
    if fmt == "legacy":
        optimizer = cpu_fp32_optimizer(model)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                 "model": {**model.state_dict(), **beside}, "optimizer": optimizer.state_dict(),
                 "opt_param_scheduler": {"max_lr": 1e-4, "lr_warmup_steps": 0, "num_steps": iteration,
                                         "lr_decay_style": "cosine", "lr_decay_steps": 100, "min_lr": 0.0},
                 "rng_state": rng_state(), "num_floating_point_operations_so_far": 12345}
        target = iteration_dir / (f"mp_rank_{tp_rank:02d}") / "model_optim_rng.pt"
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, target)
    else:
        trained_global = open_legacy(trained_tp1).load_rank(0)
        sharded = megatron_load.sharded_state_dict(model)
        for key in beside:
            sharded[key] = _replicated(key, trained_global[key], tp_rank)
        optimizer = chained_cpu_optimizer(model) if chained else cpu_fp32_optimizer(model)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": sharded,
                 "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": iteration},
                 "rng_state": ShardedObject("rng_state", rng_state(), (1, job.grid.tp.size), (0, tp_rank), replica_id=0),
                 "num_floating_point_operations_so_far": 12345}
        state["optimizer"] = optimizer.sharded_state_dict(state["model"])
        iteration_dir.mkdir(parents=True, exist_ok=True)
        with cpu_stand_ins():
            dist_checkpointing.save(state, str(iteration_dir))
    if rank == 0:
        (Path(out) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return True


def megatron_written(capsys, tmp: Path, family: str, tp: int, fmt: str, base: Path, trained: Path,
                     iterations=(ITERATION,), part: str | None = None, chained: bool = False) -> Path:
    """A directory as Megatron's savers write it, ``iterations`` of it (each the trained weights);
    ``part``: of that part of the model alone, trained in its own class (the language model in
    ``GPTModel``, as Megatron-LM trains it where it cannot build the whole)."""
    chosen = ("--part", part) if part else ()
    for name, src, at in (("base_mcore", base, tp), ("trained_mcore", trained, tp), ("trained_tp1", trained, 1)):
        if (tmp / name).exists() and name == "trained_tp1":
            continue
        code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", tmp / name, "--to", "mcore",
                                 "--format", "legacy", "--tp", at, "--force", *chosen)
        assert code == 0, out + err
    out = tmp / f"megatron_{fmt}_tp{tp}"
    for iteration in iterations:
        if tp == 1:
            _save_rank(0, 1, str(tmp / "base_mcore"), str(tmp / "trained_mcore"), str(tmp / "trained_tp1"),
                       str(out), fmt, iteration, chained)
        else:
            runtime.spawn(_save_rank, tp, str(tmp / "base_mcore"), str(tmp / "trained_mcore"),
                          str(tmp / "trained_tp1"), str(out), fmt, iteration, chained)
    assert not (out / "mmparity.json").exists() and not (out / "hf_config.json").exists()
    return out


def check_export(capsys, src: Path, dst: Path, base: Path, trained: Path, *extra) -> dict:
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", dst, "--to", "hf", "--base", base, *extra)
    assert code == 0, out + err
    manifest = json.loads((dst / "mmparity.json").read_text())
    from_base = set(manifest["extra"].get("from_base", {}).get("tensors", []))
    got, want, original = (load_safetensors_state_dict(d) for d in (dst, trained, base))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        expected = original[key] if key in from_base else value
        assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), key
    changed = [k for k in want if k not in from_base and not torch.equal(want[k], original[k])]
    assert changed, "a negative control: the trained weights differ from the base's"
    assert (dst / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert (dst / "tokenizer_config.json").read_bytes() == (base / "tokenizer_config.json").read_bytes()
    if from_base:
        assert "from the base, not trained" in out
    return {"from_base": from_base, "out": out}


def side_expected(family: str) -> bool:
    """Whether the family keeps tensors Megatron has no place for (so the base must supply them)."""
    return family in ("llava", "clip")


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", FAST)
def test_megatron_written_tp1_exports_bit_exact(capsys, tmp_path, family, fmt):
    base, trained = make_pair(family, tmp_path)
    ckpt = megatron_written(capsys, tmp_path, family, 1, fmt, base, trained)
    result = check_export(capsys, ckpt, tmp_path / "hf", base, trained)
    assert bool(result["from_base"]) == side_expected(family)


@pytest.mark.parametrize("family", WHOLE)
def test_megatron_written_whole_vlms_tp1(capsys, tmp_path, family):
    base, trained = make_pair(family, tmp_path)
    for fmt in ("legacy", "torch_dist"):
        ckpt = megatron_written(capsys, tmp_path, family, 1, fmt, base, trained)
        check_export(capsys, ckpt, tmp_path / f"hf_{fmt}", base, trained)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", FAST + WHOLE)
def test_megatron_written_tp2_exports_bit_exact(capsys, tmp_path, family, fmt):
    base, trained = make_pair(family, tmp_path)
    ckpt = megatron_written(capsys, tmp_path, family, 2, fmt, base, trained)
    check_export(capsys, ckpt, tmp_path / "hf", base, trained)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", ["llava", *WHOLE])
def test_language_model_trained_alone_exports_the_whole_release(capsys, tmp_path, family, fmt):
    """Megatron-LM trains the language model alone as GPTModel (no tower, no projector, its keys
    unprefixed); the export is the whole release: the trained language model, the rest the
    base's, listed with counts and bytes."""
    base, trained = make_pair(family, tmp_path)
    ckpt = megatron_written(capsys, tmp_path, family, 1, fmt, base, trained, part="language_model")
    stored = (torch.load(ckpt / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt",
                         weights_only=False)["model"] if fmt == "legacy" else {})
    assert all(k.startswith(("embedding.", "decoder.", "output_layer.")) for k in stored), sorted(stored)[:5]
    result = check_export(capsys, ckpt, tmp_path / "hf", base, trained)
    original = load_safetensors_state_dict(base)
    tower = {k for k in original if "language_model" not in k and not k.startswith(("lm_head", "output."))}
    assert tower and tower <= result["from_base"], sorted(tower - result["from_base"])[:5]
    assert not any("language_model" in k for k in result["from_base"]), sorted(result["from_base"])[:5]
    assert f"{len(result['from_base'])} tensors (" in result["out"]
    # A config alone describes the model but holds no tower: one line asking for the base, nothing written.
    code, out, err = run_cli(capsys, "convert", "--src", ckpt, "--dst", tmp_path / "nothing", "--to", "hf",
                             "--hf-config", base / "config.json", "--family", family)
    assert code == 2 and "language_model alone" in err and "--base" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "nothing").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", ["mistral3", "kimi_k25_vl"])
def test_language_model_trained_alone_tp2(capsys, tmp_path, family, fmt):
    base, trained = make_pair(family, tmp_path)
    ckpt = megatron_written(capsys, tmp_path, family, 2, fmt, base, trained, part="language_model")
    check_export(capsys, ckpt, tmp_path / "hf", base, trained)


def test_iterations_are_never_mixed(capsys, tmp_path):
    """Two iterations: the tracker's is the default, ``--iteration`` picks the other, whole."""
    base, trained = make_pair("clip", tmp_path)
    ckpt = megatron_written(capsys, tmp_path, "clip", 1, "legacy", base, trained, iterations=(3, ITERATION))
    # Iteration 3 is made to hold the base's weights: exporting it gives the base back.
    shutil.rmtree(ckpt / "iter_0000003")
    code, out, err = run_cli(capsys, "convert", "--src", base, "--dst", tmp_path / "base_legacy", "--to", "mcore",
                             "--format", "legacy")
    assert code == 0, out + err
    shutil.copytree(tmp_path / "base_legacy" / "iter_0000001", ckpt / "iter_0000003")
    check_export(capsys, ckpt, tmp_path / "hf7", base, trained)  # the tracker's: 7
    code, out, err = run_cli(capsys, "convert", "--src", ckpt, "--dst", tmp_path / "hf3", "--to", "hf",
                             "--base", base, "--iteration", "3")
    assert code == 0, out + err
    got, original = load_safetensors_state_dict(tmp_path / "hf3"), load_safetensors_state_dict(base)
    assert all(torch.equal(got[k], original[k]) for k in original)
    code, out, err = run_cli(capsys, "convert", "--src", ckpt, "--dst", tmp_path / "hf5", "--to", "hf",
                             "--base", base, "--iteration", "5")
    assert code == 2 and "iter_0000005" in err and not (tmp_path / "hf5").exists()


def test_without_base_says_what_it_needs(capsys, tmp_path):
    base, trained = make_pair("clip", tmp_path)
    ckpt = megatron_written(capsys, tmp_path, "clip", 1, "torch_dist", base, trained)
    code, out, err = run_cli(capsys, "convert", "--src", ckpt, "--dst", tmp_path / "hf", "--to", "hf")
    assert code == 2 and "--base HF_DIR" in err and len(err.strip().splitlines()) == 1
    # A config alone does not hold CLIP's ln_post: it says so, and that --base does.
    code, out, err = run_cli(capsys, "convert", "--src", ckpt, "--dst", tmp_path / "hf", "--to", "hf",
                             "--hf-config", base / "config.json")
    assert code == 2 and "--base" in err and "ln_post" in err and not (tmp_path / "hf").exists()


def test_shape_mismatch_with_the_base_is_one_line(capsys, tmp_path):
    base, trained = make_pair("clip", tmp_path)
    ckpt = megatron_written(capsys, tmp_path, "clip", 1, "legacy", base, trained)
    other = tmp_path / "other"
    shutil.copytree(base, other)
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] * 2
    (other / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(capsys, "convert", "--src", ckpt, "--dst", tmp_path / "hf", "--to", "hf",
                             "--base", other)
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "hf").exists(), err


def test_verify_describes_megatron_written(capsys, tmp_path):
    base, trained = make_pair("clip", tmp_path)
    for fmt in ("legacy", "torch_dist"):
        ckpt = megatron_written(capsys, tmp_path, "clip", 1, fmt, base, trained)
        code, out, err = run_cli(capsys, "verify", ckpt)
        assert code == 0, out + err
        assert f"Megatron-written {fmt} checkpoint, iteration 7" in out
        assert "optimizer" in out and "RNG" in out and "args" in out and "TP 1" in out


def test_verify_base_compares_untrained_tensors(capsys, tmp_path):
    base, trained = make_pair("clip", tmp_path)
    ckpt = megatron_written(capsys, tmp_path, "clip", 1, "legacy", base, trained)
    result = check_export(capsys, ckpt, tmp_path / "hf", base, trained)
    code, out, err = run_cli(capsys, "verify", tmp_path / "hf", "--base", base)
    assert code == 0 and f"{len(result['from_base'])} tensors from the base, not trained, equal" in out, out + err
    # A negative control: another base (its ln_post changed) is told apart.
    from safetensors.torch import save_file

    other = shutil.copytree(base, tmp_path / "other")
    state = load_safetensors_state_dict(other)
    key = sorted(result["from_base"])[0]
    state[key] = state[key] + 1
    for f in other.glob("*.safetensors*"):
        f.unlink()
    save_file(state, str(other / "model.safetensors"))
    code, out, err = run_cli(capsys, "verify", tmp_path / "hf", "--base", other)
    assert code == 1 and key in out and "differ" in out, out + err


def verify_load(capsys, ckpt: Path, *extra) -> tuple[int, str, str]:
    return run_cli(capsys, "verify", ckpt, "--load", *extra)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", FAST)
def test_verify_load_megatron_written_tp1(capsys, tmp_path, family, fmt):
    """``verify --load --base`` of what Megatron's savers wrote: strict, the model only; the
    optimizer, RNG and args named as deliberately not loaded."""
    base, trained = make_pair(family, tmp_path)
    ckpt = megatron_written(capsys, tmp_path, family, 1, fmt, base, trained)
    code, out, err = verify_load(capsys, ckpt)
    assert code == 2 and "--base HF_DIR" in err and len(err.strip().splitlines()) == 1, out + err
    code, out, err = verify_load(capsys, ckpt, "--base", base)
    assert code == 0, out + err
    assert f"(mcore_{fmt}, TP 1)" in out and "all ranks load" in out and "rank 0: ok" in out, out
    deliberately = next(line for line in out.splitlines() if "not loaded, deliberately" in line)
    assert "optimizer" in deliberately and "rng_state" in deliberately and "args" in deliberately, out
    if fmt == "torch_dist":
        assert "training state" in out, out  # the per-rank count of optimizer / RNG items skipped
    # A config alone describes a load (Megatron's class has no place for what only the base holds).
    code, out3, err = verify_load(capsys, ckpt, "--hf-config", base / "config.json")
    assert code == 0 and "all ranks load" in out3 and "--hf-config" in out3, out3 + err
    code, out2, err = verify_load(capsys, ckpt, "--base", base, "--iteration", "7")
    assert code == 0 and out2 == out, out2 + err
    code, out, err = verify_load(capsys, ckpt, "--base", base, "--iteration", "5")
    assert code == 2 and "iter_0000005" in err, out + err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_verify_load_megatron_written_tp2(capsys, tmp_path, fmt):
    base, trained = make_pair("llava", tmp_path)
    ckpt = megatron_written(capsys, tmp_path, "llava", 2, fmt, base, trained)
    code, out, err = verify_load(capsys, ckpt, "--base", base)
    assert code == 0, out + err
    assert f"(mcore_{fmt}, TP 2)" in out and "rank 0: ok" in out and "rank 1: ok" in out, out
    assert "optimizer" in out and "rng_state" in out, out


def _legacy_rank_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("iter_*/mp_rank_*/model_optim_rng.pt"))


@pytest.mark.parametrize("change", ["shape", "removed"])
def test_verify_load_megatron_written_legacy_misfit_fails_naming_it(capsys, tmp_path, change):
    """A negative control: one model tensor of a Megatron-written legacy checkpoint re-shaped or
    removed (its optimizer, RNG and args kept) is a failed rank naming it."""
    base, trained = make_pair("clip", tmp_path)
    ckpt = megatron_written(capsys, tmp_path, "clip", 1, "legacy", base, trained)
    (path,) = _legacy_rank_files(ckpt)
    state = torch.load(path, weights_only=False)
    key = sorted(k for k, v in state["model"].items() if torch.is_tensor(v) and k.endswith("linear_fc1.bias"))[0]
    if change == "shape":
        state["model"][key] = torch.cat([state["model"][key], state["model"][key][:1]])
    else:
        del state["model"][key]
    torch.save(state, path)
    code, out, err = verify_load(capsys, ckpt, "--base", base)
    if change == "shape":  # checked against the config before anything is built: one line
        assert code == 2 and key in err and "shape mismatch" in err and len(err.strip().splitlines()) == 1, out + err
    else:
        assert code == 1 and f"rank 0: FAIL: missing 1: {key}" in out, out + err


def test_verify_load_megatron_written_torch_dist_misfit_fails_naming_it(capsys, tmp_path):
    """The same for torch_dist: a model tensor removed from the saved state is named."""
    base, trained = make_pair("clip", tmp_path)
    ckpt = megatron_written(capsys, tmp_path, "clip", 1, "torch_dist", base, trained)
    # Saved again without one model tensor (Megatron's saver given a state dict lacking it).
    shutil.rmtree(ckpt)
    original = _save_rank

    removed = {}

    def without_one(rank, world, *rest):
        from megatron.core import dist_checkpointing

        real = dist_checkpointing.save

        def save(state, directory, *a, **k):
            first = sorted(k for k in state["model"] if k.endswith("linear_fc1.bias"))[0]
            removed["key"] = state["model"][first].key
            # Every layer's shard of the stacked tensor, so that what is saved is a whole checkpoint.
            for name in [k for k, v in state["model"].items() if getattr(v, "key", None) == removed["key"]]:
                state["model"].pop(name)
            state["optimizer"] = {}  # its optimizer state refers to the removed tensor
            return real(state, directory, *a, **k)

        dist_checkpointing.save = save
        try:
            return original(rank, world, *rest)
        finally:
            dist_checkpointing.save = real

    without_one(0, 1, str(tmp_path / "base_mcore"), str(tmp_path / "trained_mcore"), str(tmp_path / "trained_tp1"),
                str(ckpt), "torch_dist", ITERATION)
    code, out, err = verify_load(capsys, ckpt, "--base", base)
    assert code == 1 and "rank 0: FAIL" in out and removed["key"] in out, out + err


def test_a_chained_optimizers_state_is_not_taken_for_weights(capsys, tmp_path):
    """A MoE model's optimizer under expert parallelism is a chain (dense, experts), whose
    torch_dist state Megatron saves under ``chained_0.optimizer.…`` / ``chained_1.optimizer.…``:
    training state, like ``optimizer.…``, not tensors of the model."""
    from mmparity.io.torch_dist_files import TorchDistFiles

    base, trained = make_pair("kimi_k25_vl", tmp_path)
    ckpt = megatron_written(capsys, tmp_path, "kimi_k25_vl", 1, "torch_dist", base, trained,
                            part="language_model", chained=True)
    stored = TorchDistFiles(ckpt / f"iter_{ITERATION:07d}").tensors
    assert any(k.startswith("chained_1.optimizer.") for k in stored)
    code, out, err = run_cli(capsys, "verify", ckpt)
    assert code == 0 and "optimizer" in out.split("holds:")[1].split(";")[0], out + err
    check_export(capsys, ckpt, tmp_path / "hf", base, trained)
