"""convert's own output passes ``check --mcore`` and ``verify --load``: every family (and LLaVA on
the CLIP tower, the one Megatron's stock LLaVAModel builds) x TP {1, 2} x {legacy, torch_dist}.

Everything runs in-process through ``mmparity.cli.main.main``; each checkpoint is converted once
(module-scoped) and shared by its two checks. TP 2 spawns two gloo ranks: those cells are ``slow``.
torch_dist holds global tensors, so its TP-2 cell runs ``--tp 2``. A family whose heads TP 2 does
not divide skips its TP-2 cells with the reason; ``verify --load`` of a family whose Megatron class
needs Megatron-LM main (``vit_model``) skips where that is not importable.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mmparity.models import registry as families
from mmparity.models.registry import megatron_class
from mmparity.models.spec import NoMegatronClass
from mmparity.cli.main import main
from mmparity.models.core import megatron_classes as models
from mmparity.models.pixtral import megatron as pixtral_megatron
from tests.mapping.test_convert_roundtrips import save_hf
from tests.megatron.test_megatron_load import llava_clip_config

# (grid name, family, config factory or None for the family's tiny config)
ENTRIES = [(name, name, None) for name in families.names()] + [("llava_clip", "llava", llava_clip_config)]
FORMATS = ["legacy", "torch_dist"]


def _cells():
    for name, _, _ in ENTRIES:
        for tp in (1, 2):
            for fmt in FORMATS:
                marks = [pytest.mark.slow] if tp > 1 else []
                yield pytest.param(name, tp, fmt, marks=marks, id=f"{name}-tp{tp}-{fmt}")


CELLS = list(_cells())


def _entry(name: str):
    return next(e for e in ENTRIES if e[0] == name)


def _config(name: str):
    _, family, factory = _entry(name)
    return factory() if factory is not None else families.get(family).tiny_config()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """convert's output for (entry, TP, format), made once when first asked for."""
    root = tmp_path_factory.mktemp("grid")
    hf, made = {}, {}

    def _checkpoint(name: str, tp: int, fmt: str) -> Path:
        _, family, _ = _entry(name)
        problems = families.get(family).rule_set(_config(name)).validate_tp
        problems = list(problems(tp)) if problems and tp > 1 else []
        if problems:
            pytest.skip(f"{name}: TP {tp} does not divide its tiny config: {'; '.join(problems)[:200]}")
        if name not in hf:
            hf[name] = save_hf(family, root / "hf" / name, seed=11, cfg=_config(name))
        key = (name, tp, fmt)
        if key not in made:
            dst = root / f"{name}_tp{tp}_{fmt}"
            argv = ["convert", "--family", family, "--src", str(hf[name]), "--dst", str(dst), "--to", "mcore",
                    "--format", fmt, "--tp", str(tp), "--quiet"]
            code = main(argv)
            assert code == 0, argv
            made[key] = dst
        return made[key]

    return _checkpoint


def _at_tp(fmt: str, tp: int) -> list[str]:
    """A legacy checkpoint runs at its own TP; torch_dist (global tensors) at the one asked for."""
    return ["--tp", str(tp)] if fmt == "torch_dist" and tp > 1 else []


@pytest.mark.parametrize("name, tp, fmt", CELLS)
def test_check_mcore(name, tp, fmt, checkpoints, capsys):
    directory = checkpoints(name, tp, fmt)
    capsys.readouterr()
    code = main(["check", "--mcore", str(directory), "--no-components", "--quiet", *_at_tp(fmt, tp)])
    out, err = capsys.readouterr()
    assert code == 0, out + err


def _require_megatron_class(name: str) -> None:
    """Skip where the family's record says Megatron has no class for it (``NoMegatron``), and (with
    UpstreamUnavailable's reason) where Megatron's class for this entry cannot be imported here: Megatron-LM main's vit_model for pixtral, pixtral_large, qwen3_5, kimi_k25, and
    for LLaVA on a Pixtral tower."""
    _, family, _ = _entry(name)
    try:
        needed = [megatron_class(family)[1].build]
    except NoMegatronClass as exc:  # the family's record says Megatron has no class for it
        pytest.skip(f"{name}: {exc}")
    if family == "llava" and _config(name).vision_config.model_type == "pixtral":
        needed.append(pixtral_megatron.build_pixtral)
    for builder in needed:
        try:
            models.require(builder)
        except models.UpstreamUnavailable as exc:
            pytest.skip(f"{name}: {exc}")


@pytest.mark.parametrize("name, tp, fmt", CELLS)
def test_verify_load(name, tp, fmt, checkpoints, capsys):
    _require_megatron_class(name)
    directory = checkpoints(name, tp, fmt)
    capsys.readouterr()
    code = main(["verify", "--load", str(directory), *_at_tp(fmt, tp)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert f"TP {tp}" in out and all(f"rank {r}: ok" in out for r in range(tp)), out
