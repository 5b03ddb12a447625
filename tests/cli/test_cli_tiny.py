"""`mmparity tiny`: a family's tiny HF model on disk, as the README's quick start uses it.

What it writes must be a real conversion source (HF -> mcore -> HF gives every tensor back bit for
bit), the same for the same seed, and its user errors are one line, exit 2, nothing written.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from mmparity.cli.main import main


def run(*argv) -> int:
    return main([str(a) for a in argv])


def same_tensors(got: Path, expected: Path) -> None:
    want, have = load_safetensors_state_dict(expected), load_safetensors_state_dict(got)
    assert sorted(have) == sorted(want)
    for key, value in want.items():
        assert have[key].dtype == value.dtype and torch.equal(have[key], value), key
    assert (got / "config.json").read_bytes() == (expected / "config.json").read_bytes()


def test_quick_start_round_trip_of_a_whole_vlm_part(tmp_path, capsys):
    """The README's quick start: Kimi-K2.5's language model alone at TP 2 x EP 2, exported whole
    with --base; the written model file is the source's, byte for byte."""
    hf, mcore, back = tmp_path / "hf", tmp_path / "mcore", tmp_path / "hf2"
    assert run("tiny", "kimi_k25_vl", hf) == 0
    out = capsys.readouterr().out
    assert out.startswith("wrote tiny kimi_k25_vl (seed 0): ") and out.count("\n") == 1
    assert {p.name for p in hf.iterdir()} >= {"config.json", "model.safetensors"}
    assert run("convert", "--src", hf, "--dst", mcore, "--to", "mcore", "--part", "language_model",
               "--format", "legacy", "--tp", 2, "--ep", 2, "--quiet") == 0
    assert len(list((mcore / "iter_0000001").glob("mp_rank_*"))) == 4
    assert run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--base", hf, "--quiet") == 0
    same_tensors(back, hf)
    assert (back / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()


def test_reference_wrapper_round_trip_and_seeds(tmp_path, capsys):
    """pixtral_large's reference is a wrapper without save_pretrained: written as save_pretrained
    lays a model out, it converts both ways bit-exact; a seed gives the same bytes every time. Its
    config is the whole Mistral3's, which detection gives to mistral3: tiny says to name the family."""
    first, again, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert run("tiny", "pixtral_large", first, "--seed", 3) == 0
    note = capsys.readouterr().out.splitlines()[1]
    assert "for mistral3" in note and "--family pixtral_large" in note
    assert run("tiny", "pixtral_large", again, "--seed", 3) == 0
    assert run("tiny", "pixtral_large", other, "--seed", 4) == 0
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "model.safetensors"]
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert run("convert", "--family", "pixtral_large", "--src", first, "--dst", mcore, "--to", "mcore",
               "--format", "legacy", "--tp", 2, "--quiet") == 0
    assert run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet") == 0
    same_tensors(back, first)


def test_refusals_are_one_line_naming_the_fix(tmp_path, capsys):
    assert run("tiny", "no_such_family", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "FAMILY 'no_such_family'" in err and "kimi_k25_vl" in err
    assert not (tmp_path / "x").exists()

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert run("tiny", "clip", taken) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and "--force" in err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]

    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    assert run("tiny", "clip", a_file, "--force") == 2
    assert "not a directory" in capsys.readouterr().err and a_file.read_text() == "mine"

    assert run("tiny", "clip", taken, "--seed", -1) == 2
    assert "--seed" in capsys.readouterr().err

    assert run("tiny", "clip", taken, "--force") == 0
    assert (taken / "model.safetensors").exists() and not (taken / "keep.txt").exists()


def test_help_shows_one_example(capsys):
    try:
        run("tiny", "--help")
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert out.count("example:") == 1 and "mmparity tiny kimi_k25_vl hf/" in out
