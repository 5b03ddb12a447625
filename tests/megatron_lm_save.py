"""Run by tests/megatron/test_megatron_lm_save.py in a subprocess: Megatron-LM main's own
``save_checkpoint`` saves a CLIP model (Megatron's class, loaded from mmparity's conversion of a
changed HF model), then ``convert --to hf --base`` must give the changed weights bit-exactly.

``python tests/megatron_lm_save.py FORMAT WORKDIR`` with Megatron-LM first on PYTHONPATH. Exit 77:
Megatron-LM's training code does not import here. CPU stand-ins (CUDA RNG state, device sync, the
tokenizer the finalizer saves) are set here only, never in mmparity.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path


def run(fmt: str, tmp: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    # Megatron-LM has a `tests` package of its own; this repository's test helpers by path.
    package = types.ModuleType("tests")
    package.__path__ = [str(repo / "tests")]
    sys.modules["tests"] = package
    try:
        from megatron.training import global_vars
        from megatron.training.arguments import parse_args
        import megatron.training.checkpointing as checkpointing
    except Exception as exc:  # noqa: BLE001 - any import failure means: not here
        print(f"Megatron-LM's training code does not import: {type(exc).__name__}: {exc}")
        sys.exit(77)
    import torch

    from mmparity.megatron import load as megatron_load
    from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
    from mmparity.io.legacy import open_legacy
    from mmparity.cli.main import main
    from tests.io.test_megatron_written import cpu_fp32_optimizer, cpu_stand_ins, make_pair

    base, trained = make_pair("clip", tmp)
    for name, src in (("base_mcore", base), ("trained_mcore", trained)):
        assert main(["convert", "--src", str(src), "--dst", str(tmp / name), "--to", "mcore", "--format", "legacy",
                     "--quiet"]) == 0
    job, *_ = megatron_load.load_job(tmp / "base_mcore")
    job.init_parallel()
    model, *_ = megatron_load._load(0, job)
    own, changed = model.state_dict(), open_legacy(tmp / "trained_mcore").load_rank(0)
    megatron_load.load_state_dict_strictly(model, {k: changed.get(k, own[k]) for k in own})
    sys.argv = [sys.argv[0]]
    args = parse_args(ignore_unknown_args=True)
    args.save, args.ckpt_format, args.use_dist_ckpt = str(tmp / "megatron"), fmt, fmt == "torch_dist"
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = args.data_parallel_size = 1
    args.async_save, args.no_save_optim, args.no_save_rng = False, False, False
    global_vars.set_args(args)
    optimizer = cpu_fp32_optimizer(model)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    model.state_dict_for_save_checkpoint = lambda *a, **k: model.state_dict()
    checkpointing.save_tokenizer_assets = lambda *a, **k: None
    checkpointing.get_tokenizer = lambda: None
    with cpu_stand_ins():
        checkpointing.save_checkpoint(7, [model], optimizer, None, 0)
    assert main(["verify", str(tmp / "megatron")]) == 0
    assert main(["convert", "--src", str(tmp / "megatron"), "--dst", str(tmp / "hf"), "--to", "hf",
                 "--base", str(base)]) == 0
    manifest = json.loads((tmp / "hf" / "mmparity.json").read_text())
    from_base = set(manifest["extra"]["from_base"]["tensors"])
    got, want, original = (load_safetensors_state_dict(d) for d in (tmp / "hf", trained, base))
    wrong = [k for k in want if not torch.equal(got[k], original[k] if k in from_base else want[k])]
    assert sorted(got) == sorted(want) and not wrong and from_base, (wrong, from_base)
    print(f"MEASURED {fmt}: {len(want)} tensors bit-exact, {len(from_base)} from the base")


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]))
