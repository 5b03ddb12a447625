"""The training loop through Megatron-LM's own checkpoint code (``megatron.training.checkpointing``).

HF release -> ``mmparity convert`` -> Megatron-LM's ``load_checkpoint`` into Megatron's class ->
weights changed as training would -> Megatron-LM's ``save_checkpoint`` (args, RNG, rerun state and
the iteration, as it writes them) -> ``mmparity convert --to hf --base`` -> HF again, bit-exact.

Megatron-LM's training code is in no release (its ``main`` only, Python >= 3.12): these tests run
where its checkout is first on ``PYTHONPATH`` and skip otherwise, as in CI. The stand-ins for the
CUDA calls Megatron-LM's checkpointing makes unconditionally (the CUDA RNG state) live here, in
the test harness, never in mmparity.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.cli.main import main
from tests.mapping.test_convert_roundtrips import save_hf


def _megatron_lm_training() -> str | None:
    if sys.version_info < (3, 12):
        return "Megatron-LM main's training code needs Python >= 3.12 (typing.override)"
    try:
        found = importlib.util.find_spec("megatron.training.checkpointing") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return ("needs Megatron-LM main's megatron.training on PYTHONPATH (no release has it; CI cannot "
                "fetch it)")
    return None


SKIP = _megatron_lm_training()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

ITERATION = 7


def _megatron_lm_args(cfg, tp: int, pp: int, fmt: str, load: str, save: str, finetune: bool):
    """Megatron-LM's parsed and validated ``args`` for this language model, as its launcher makes
    them (the sizes are what its checkpoint records and compares)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    text = cfg.text_config
    argv = ["megatron-lm",
            "--num-layers", str(text.num_hidden_layers), "--hidden-size", str(text.hidden_size),
            "--ffn-hidden-size", str(text.intermediate_size),
            "--num-attention-heads", str(text.num_attention_heads),
            "--group-query-attention", "--num-query-groups", str(text.num_key_value_heads),
            "--seq-length", "32", "--max-position-embeddings", str(text.max_position_embeddings),
            "--micro-batch-size", "1", "--lr", "1e-4", "--train-iters", "10", "--save-interval", "5",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--vocab-size", str(text.vocab_size), "--tokenizer-type", "NullTokenizer",
            "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--transformer-impl", "local",
            "--ckpt-format", "torch" if fmt == "legacy" else "torch_dist",
            "--load", load, "--save", save, "--no-save-optim"]
    if finetune:
        argv += ["--finetune", "--no-load-optim", "--no-load-rng"]
    saved, sys.argv = sys.argv, argv
    try:
        args = parse_args()
        validate_args(args)
    finally:
        sys.argv = saved
    # Tokenizer files are the release's; --base copies them into the HF export.
    args.save_tokenizer_assets = False
    set_args(args)
    return args


class _CpuTorch:
    """``torch`` as Megatron-LM's checkpointing module sees it on a CPU-only machine: tensors it
    places on ``cuda`` (the tracker's iteration, reduced across ranks) are made on the CPU, where
    gloo reduces them; everything else is torch itself."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def tensor(self, *args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return self._torch.tensor(*args, device=device, **kwargs)


def _cpu_stand_ins() -> None:
    """Megatron-LM's checkpointing makes CUDA calls whatever the device (the CUDA RNG state, the
    tracker's iteration as a CUDA tensor, a device fence
    before writing); on a CPU-only machine, stand-ins (harness only)."""
    if torch.cuda.is_available():
        return
    from megatron.training import arguments, checkpointing

    # Its argument check reads the GPU's architecture at TP > 1 (a CUDA launch-queue setting).
    arguments.get_device_arch_version = lambda: 10
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
    torch.cuda.synchronize = lambda *a, **k: None  # the async writer's fence before it copies
    torch.cuda.current_device = lambda: "cpu"  # where the saver's failure flag is broadcast from
    if not isinstance(checkpointing.torch, _CpuTorch):
        checkpointing.torch = _CpuTorch(torch)


def _loop_rank(rank: int, world: int, params: dict) -> dict:
    from megatron.training import checkpointing

    from mmparity.megatron import load as megatron_load

    _cpu_stand_ins()
    job = megatron_load.load_job(params["src"], tp=params["tp"])[0]
    job.init_parallel()
    cfg = job.cfg
    _megatron_lm_args(cfg, job.grid.tp.size, job.grid.pp.size, params["format"], params["src"], params["save"],
                      finetune=params["finetune"])
    # What mmparity's own strict loader reads out of its checkpoint: the reference for Megatron-LM's.
    reference = megatron_load.build_and_load(rank, world, job)
    model = megatron_load._build(rank, job)[0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    iteration, _ = checkpointing.load_checkpoint([model], None, None, strict=True)
    loaded = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
    want = {k: v for k, v in reference.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
    unequal = sorted(k for k in want if k not in loaded or not torch.equal(loaded[k], want[k]))
    # Training: every weight moves. Replicated weights move alike on every TP rank (their gradients
    # are all-reduced), TP-split ones each by their own shard's noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            split = getattr(p, "tensor_model_parallel", False)
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (rank + 1 if split else 0))
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 1e-2)
    checkpointing.save_checkpoint(ITERATION, [model], None, None, 0)
    trained = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if torch.is_tensor(v) and not k.endswith("_extra_state")}
    from safetensors.torch import save_file

    save_file(trained, os.path.join(params["trained"], f"rank{rank}.safetensors"))
    return {"iteration": iteration, "unequal": unequal[:10], "keys": len(want)}


def _llava_clip():
    # A CLIP tower: Megatron-LM main's LLaVAModel builds no vit_model tower (docs/megatron.md).
    from mmparity.models.llava.megatron import llava_clip_config

    return llava_clip_config()


# The whole VLMs Megatron-LM's own LLaVAModel builds: LLaVA on a CLIP tower, InternVL on its
# InternViT (the class token dropped, the 2x2 pixel shuffle, the normed projector).
WHOLE = {"llava": _llava_clip, "internvl": lambda: families.get("internvl").tiny_config()}


@pytest.fixture(scope="module", params=sorted(WHOLE))
def whole(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, save_hf(family, tmp_path_factory.mktemp("mlm_loop") / "hf", seed=5, cfg=WHOLE[family]())


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("tp", [1, 2])
def test_into_megatron_lm_and_back(whole, tmp_path, fmt, tp):
    family, hf_dir = whole
    src = tmp_path / "mmparity"
    assert main(["convert", "--family", family, "--src", str(hf_dir), "--dst", str(src), "--to", "mcore",
                 "--format", fmt, "--tp", str(tp), "--quiet"]) == 0
    save, trained = tmp_path / "megatron_lm", tmp_path / "trained"
    trained.mkdir()
    params = {"src": str(src), "save": str(save), "trained": str(trained), "format": fmt, "finetune": True, "tp": tp}
    results = runtime.spawn(_loop_rank, tp, params) if tp > 1 else [_loop_rank(0, 1, params)]
    for r in results:
        assert not r["unequal"], r
    # What Megatron-LM wrote: its tracker and iteration directory.
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATION)
    assert (save / f"iter_{ITERATION:07d}").is_dir()
    out = tmp_path / "hf_again"
    code = main(["convert", "--src", str(save), "--dst", str(out), "--to", "hf", "--base", str(hf_dir), "--quiet"])
    assert code == 0
    _assert_trained_weights_exported(family, hf_dir, out, trained, tp)


def _assert_trained_weights_exported(name: str, hf_dir: Path, out: Path, trained: Path, tp: int) -> None:
    """The HF export equals what mmparity's own engine makes of the trained per-rank weights, with
    the tensors Megatron has no place for taken from the base: bit for bit."""
    from safetensors.torch import load_file

    from mmparity.convert.configs import read_hf_config

    family = families.get(name)
    cfg = read_hf_config(hf_dir)[0]
    base = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        base.update(load_file(f))
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    shards = [load_file(trained / f"rank{r}.safetensors") for r in range(tp)]
    fmt = family.rule_set(cfg, keys=base.keys()).hf_format  # the base's own layout, as the export's
    side = family.hf_to_mcore(base, cfg, tp_size=tp, hf_format=fmt).side
    expected = family.mcore_to_hf(shards, cfg, hf_format=fmt, side=side)
    assert set(got) == set(base), sorted(set(base) ^ set(got))[:10]
    unequal = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not unequal, unequal[:10]
    # Training moved what Megatron's class holds; what it has no place for (LLaVA's CLIP
    # post-norm, say) came back from the base untouched. InternVL's class holds every tensor.
    moved = [k for k in base if not torch.equal(got[k], base[k])]
    untouched = [k for k in base if k not in moved]
    held_aside = any(len(rank) for rank in side)
    assert moved and bool(untouched) == held_aside, (len(moved), len(untouched), held_aside)
