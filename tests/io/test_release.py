"""`convert --to mcore --release`: Megatron-LM's release checkpoint, with the `args` its loader
reads and torch_dist's content metadata, and nothing claiming training state it does not have;
read back by mmparity (`verify`, `convert --to hf`) bit for bit."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity import config as hfconfig
from mmparity.parallel import runtime
from mmparity.io import megatron_args, unpickle
from mmparity.io.layout import TRACKER_FILE
from mmparity.io.legacy import open_legacy
from tests.cli.test_convert_cli import run_cli
from tests.mapping.test_convert_roundtrips import assert_same_checkpoint, save_hf

# What Megatron-LM's loader never finds in a converted checkpoint: training state.
TRAINING_STATE = ("optimizer", "rng_state", "opt_param_scheduler", "rerun_state_machine",
                  "num_floating_point_operations_so_far")
TRAINING_ARGS = ("iteration", "consumed_train_samples", "consumed_valid_samples", "train_iters", "seed")


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    return {family: save_hf(family, root / family, seed=9) for family in ("llava", "clip")}


def convert_release(capsys, src: Path, dst: Path, fmt: str, tp: int = 1, pp: int = 1) -> Path:
    code, out, err = run_cli(capsys, "convert", "--src", src, "--dst", dst, "--to", "mcore", "--format", fmt,
                             "--tp", tp, "--pp", pp, "--release", "--quiet")
    assert code == 0, out + err
    return dst


def test_legacy_release_layout_and_args(capsys, releases, tmp_path):
    dst = convert_release(capsys, releases["llava"], tmp_path / "llava", "legacy", tp=2, pp=2)
    assert (dst / TRACKER_FILE).read_text().strip() == "release"
    assert not list(dst.glob("iter_*"))
    ckpt = open_legacy(dst)
    assert (ckpt.iteration, ckpt.tp_size, ckpt.pp_size) == ("release", 2, 2)
    cfg = families.get("llava").tiny_config()
    text = cfg.text_config
    for path in ckpt.files.values():
        payload = torch.load(path, map_location="cpu", weights_only=False,
                             pickle_module=unpickle.torch_pickle_module(unpickle.LEGACY_NAMES, str(path)))
        assert payload["iteration"] == 0 and payload["checkpoint_version"] == 3.0
        assert not [k for k in TRAINING_STATE if k in payload]
        args = payload["args"]
        assert isinstance(args, argparse.Namespace)
        assert args == megatron_args.read_legacy_args(path)
        assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups) == (
            text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads)
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
        assert args.padded_vocab_size == hfconfig.padded_vocab_size(text.vocab_size, 128, 2)
        assert args.make_vocab_size_divisible_by == 128 and args.ckpt_format == "torch"
        assert args.no_save_optim is True and args.no_save_rng is True
        assert not [k for k in TRAINING_ARGS if hasattr(args, k)]
        # Plain values only: what Megatron's safe_globals and our allow-list both decode.
        assert all(isinstance(v, (int, float, str, bool)) for v in vars(args).values())


def test_torch_dist_release_common_state_and_content_metadata(capsys, releases, tmp_path):
    dst = convert_release(capsys, releases["clip"], tmp_path / "clip", "torch_dist", tp=2)
    assert (dst / TRACKER_FILE).read_text().strip() == "release"
    release = dst / "release"
    assert (release / "metadata.json").is_file() and (release / ".metadata").is_file()
    common = unpickle.load_torch_archive((release / "common.pt").read_bytes(), where="common.pt")
    assert common["content_metadata"] == megatron_args.content_metadata()
    assert common["iteration"] == 0 and not [k for k in TRAINING_STATE if k in common]
    args = common["args"]
    vc = families.get("clip").tiny_config()
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        vc.num_hidden_layers, vc.hidden_size, vc.num_attention_heads)
    assert args.ckpt_format == "torch_dist" and args.tensor_model_parallel_size == 2
    assert not hasattr(args, "padded_vocab_size")  # a tower has no vocabulary


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", ["llava", "clip"])
def test_release_reads_back_bit_exact(capsys, releases, tmp_path, family, fmt):
    dst = convert_release(capsys, releases[family], tmp_path / "mcore", fmt, tp=2)
    code, out, err = run_cli(capsys, "verify", dst)
    assert code == 0 and "all match" in out, out + err
    code, out, err = run_cli(capsys, "convert", "--src", dst, "--dst", tmp_path / "hf", "--to", "hf", "--quiet")
    assert code == 0, out + err
    assert_same_checkpoint(tmp_path / "hf", releases[family])


def test_iteration_checkpoints_still_default_and_carry_args(capsys, releases, tmp_path):
    code, out, err = run_cli(capsys, "convert", "--src", releases["clip"], "--dst", tmp_path / "it", "--to", "mcore",
                             "--format", "legacy", "--quiet")
    assert code == 0, out + err
    assert (tmp_path / "it" / TRACKER_FILE).read_text().strip() == "1"
    args = megatron_args.read_legacy_args(tmp_path / "it" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    assert args.no_save_optim and args.no_save_rng and args.tensor_model_parallel_size == 1


def test_release_is_refused_for_hf_output(capsys, releases, tmp_path):
    code, out, err = run_cli(capsys, "convert", "--src", releases["clip"], "--dst", tmp_path / "x", "--to", "hf",
                             "--release")
    assert code == 2 and "--release" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_args_that_are_not_a_namespace_are_refused(tmp_path):
    """Negative control: the reader takes a Namespace of plain values, nothing that runs code."""

    class Loud:
        def __reduce__(self):
            return (print, ("ran",))

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {}, "args": Loud(), "checkpoint_version": 3.0}, path)
    with pytest.raises(unpickle.RefusedPickle, match="refusing to unpickle .*print"):
        megatron_args.read_legacy_args(path)
    torch.save({"model": {}, "args": {"num_layers": 2}, "checkpoint_version": 3.0}, path)
    with pytest.raises(Exception, match="not an argparse.Namespace"):
        megatron_args.read_legacy_args(path)


def _megatron_lm_training():
    try:
        from megatron.training import checkpointing
    except Exception as exc:  # stock megatron-core has no megatron.training; main needs triton importable
        pytest.skip(f"Megatron-LM main's megatron.training is not importable ({type(exc).__name__}); put a "
                    "checkout first on PYTHONPATH")
    return checkpointing


@pytest.mark.parametrize("fmt,ckpt_format", [("legacy", "torch"), ("torch_dist", "torch_dist")])
def test_megatron_lms_loader_sees_a_release_with_matching_args(capsys, releases, tmp_path, monkeypatch, fmt,
                                                               ckpt_format):
    """Megatron-LM main's own reading of the checkpoint: `_load_base_checkpoint` finds a release,
    `check_checkpoint_args` accepts the args against a run's flags (and refuses another TP for
    legacy files), and the content metadata is ours."""
    ckpt = _megatron_lm_training()
    # Megatron-LM's tracker read broadcasts on CUDA whenever a default group exists; a `check` run
    # earlier in this pytest process keeps its (gloo) group for the next one. This is the
    # single-process read a converted release gets before training starts: no group.
    runtime.teardown_parallel()
    from megatron.core import dist_checkpointing
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    dst = convert_release(capsys, releases["llava"], tmp_path / "mcore", fmt, tp=2)
    text = families.get("llava").tiny_config().text_config

    def run_args(tp: int):
        monkeypatch.setattr("sys.argv", [
            "pretrain", "--num-layers", str(text.num_hidden_layers), "--hidden-size", str(text.hidden_size),
            "--num-attention-heads", str(text.num_attention_heads), "--load", str(dst),
            "--ckpt-format", ckpt_format, "--tensor-model-parallel-size", str(tp), "--micro-batch-size", "1",
            "--seq-length", "16", "--max-position-embeddings", str(text.max_position_embeddings)])
        args = parse_args()
        args.use_dist_ckpt = args.ckpt_format != "torch"  # what validate_args derives
        global_vars.set_args(args)
        return args

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    state, _, release, _ = ckpt._load_base_checkpoint(str(dst), run_args(2), rank0=True)
    assert release is True and state["args"].no_save_optim and state["args"].no_save_rng
    ckpt.set_checkpoint_version(state.get("checkpoint_version", 0))
    ckpt.check_checkpoint_args(state["args"])
    if fmt == "legacy":
        run_args(1)
        with pytest.raises(AssertionError, match="tensor_model_parallel_size"):
            ckpt.check_checkpoint_args(state["args"])
    else:
        assert dist_checkpointing.load_content_metadata(preloaded_state_dict=state) == megatron_args.content_metadata()


@pytest.mark.slow
@pytest.mark.parametrize("fmt,ckpt_format", [("legacy", "torch"), ("torch_dist", "torch_dist")])
def test_megatron_lms_load_checkpoint_takes_a_release_with_a_plain_load(capsys, tmp_path, fmt, ckpt_format):
    """The whole of Megatron-LM main's ``load_checkpoint`` (LLaVA with a CLIP tower, CPU, one
    rank), with nothing but ``--load`` and the model's sizes: it loads at iteration 0, changes
    every tensor, and the result is exactly what ``live.import_hf`` loads from the release."""
    import json
    import os
    import subprocess
    import sys

    from mmparity.models.llava.megatron import llava_clip_config
    from mmparity.parallel.runtime import free_port

    _megatron_lm_training()
    hf_dir = save_hf("llava", tmp_path / "hf", seed=5, cfg=llava_clip_config())
    dst = convert_release(capsys, hf_dir, tmp_path / "mcore", fmt)
    script = Path(__file__).parents[1] / "megatron_lm_release_load.py"
    done = subprocess.run([sys.executable, str(script), str(dst), ckpt_format, str(hf_dir), str(free_port())],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["iteration"] == 0 and result["differ"] == []
    assert result["changed"] == result["tensors"] > 0
