"""Bounded memory of a conversion, checked where it is cheap: the largest tensors of a model are
its vocabulary tables, and a TP-merged or re-padded table must reach the output from its parts,
never as a joined (or padded) copy of the whole table made on the way.

The spy records every tensor the conversion joins from pieces (``rules.join``, ``pieces.joined``,
``ColumnJoin.tensor``) or pads whole (``PadRows.apply``); the memory figures themselves
(peak RssAnon against checkpoint size) are ``benchmarks/convert_memory.py``'s, in docs/convert.md.
"""

from __future__ import annotations

import pytest
import torch

from mmparity.convert import sources as convert_sources
from mmparity.io.formats import hf as hf_format, legacy as legacy_format, mcore as mcore_format
from mmparity.io.formats import torch_dist as torch_dist_format
from mmparity.io.fsio import heap as heap_mod
from mmparity.io.fsio import pieces as pieces_mod
from mmparity.io.fsio.safetensors_read import load_safetensors_state_dict
from mmparity.mapping import ops, rules
from mmparity.parallel import tp
from tests.mapping.test_convert_roundtrips import assert_same_checkpoint, run, save_hf


@pytest.fixture
def materialised(monkeypatch):
    """Shapes of the whole tensors the conversion makes by joining or padding."""
    made: list[tuple] = []

    def spy(fn, copies):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            if copies(*args):
                for t in (out if isinstance(out, list) else [out]):
                    if isinstance(t, torch.Tensor) and not t.is_meta:  # planning runs ops on meta tensors
                        made.append(tuple(t.shape))
            return out
        return wrapped

    def several(pieces):  # a single plain piece is handed on as it is
        return len(pieces) > 1 or isinstance(pieces[0], tp.ColumnJoin)

    monkeypatch.setattr(rules, "join", spy(rules.join, several))
    monkeypatch.setattr(pieces_mod, "joined", spy(pieces_mod.joined, several))
    for module in (convert_sources, mcore_format, hf_format):  # the modules that join pieces
        monkeypatch.setattr(module, "joined", spy(module.joined, several))
    monkeypatch.setattr(tp.ColumnJoin, "tensor", spy(tp.ColumnJoin.tensor, lambda *_: True))
    monkeypatch.setattr(ops.PadRows, "apply", spy(ops.PadRows.apply, lambda *_: True))
    return made


@pytest.mark.parametrize("family", ["llava", "mistral3"])
def test_vocabulary_tables_are_never_materialised_whole_through_tp2(family, materialised, tmp_path):
    src = save_hf(family, tmp_path / "hf", seed=3)
    tables = [tuple(t.shape) for k, t in load_safetensors_state_dict(src).items()
              if k.endswith(("embed_tokens.weight", "lm_head.weight"))]
    assert len(tables) == 2, tables
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    # 2 ranks: each holds half of each (re-padded) table; HF -> mcore pads, mcore -> HF merges.
    assert run("convert", "--family", family, "--src", src, "--dst", mcore, "--to", "mcore",
               "--format", "legacy", "--tp", 2, "--quiet") == 0
    assert run("convert", "--src", mcore, "--dst", back, "--to", "hf", "--quiet") == 0
    assert_same_checkpoint(back, src)
    whole = [s for s in materialised if len(s) == 2 and any(s[1] == cols and s[0] >= rows for rows, cols in tables)]
    assert not whole, f"a vocabulary table joined or padded whole on the way: {whole}"


class _RecordingLibc:
    """glibc's two heap calls, recorded: a free heap of ``free`` bytes."""

    def __init__(self, free: int):
        self.free, self.trims = free, 0

    def mallinfo2(self):
        return type("MallInfo2", (), {"fordblks": self.free})()

    def malloc_trim(self, pad: int) -> int:
        self.trims += 1
        return 1


def test_the_heap_is_handed_back_at_the_first_tensor_then_only_over_budget():
    budget = heap_mod.HeapBudget(budget=64 * 2**20)
    budget._libc = fake = _RecordingLibc(free=2**20)  # far below the budget
    budget.check(2**30)
    assert fake.trims == 0
    budget.begin_stream()
    budget.check(1)  # the first tensor: trimmed whatever the budget
    assert fake.trims == 1
    for _ in range(64):
        budget.check(2**20)
    assert fake.trims == 1  # below budget again: left alone
    fake.free = 65 * 2**20
    budget.check(8 * 2**20)
    assert fake.trims == 2


@pytest.mark.parametrize("target", [["--format", "torch_dist"], ["--format", "legacy", "--tp", "2"], None])
def test_every_writer_hands_the_heap_back_once_before_its_tensors(target, monkeypatch, tmp_path):
    """hf -> torch_dist, hf -> legacy and mcore -> hf: begin_stream once, after the setup (before
    any tensor passed through the heap budget), not again."""
    events: list[str] = []

    class Recording(heap_mod.HeapBudget):
        def begin_stream(self):
            events.append("begin_stream")
            super().begin_stream()

        def check(self, nbytes):
            events.append("check")
            super().check(nbytes)

    recording = Recording()
    for module in (hf_format, legacy_format, torch_dist_format):  # each writer's budget
        monkeypatch.setattr(module, "heap_budget", lambda: recording)
    src = save_hf("llava", tmp_path / "hf", seed=5)
    mcore = tmp_path / "mcore"
    assert run("convert", "--family", "llava", "--src", src, "--dst", mcore, "--to", "mcore",
               *(target or ["--format", "torch_dist"]), "--quiet") == 0
    if target is None:  # the mcore -> hf writer
        events.clear()
        assert run("convert", "--src", mcore, "--dst", tmp_path / "back", "--to", "hf", "--quiet") == 0
    assert events[0] == "begin_stream" and events.count("begin_stream") == 1, events[:3]
    assert events.count("check") > 10


@pytest.mark.parametrize("target", [["--format", "torch_dist"], ["--format", "legacy", "--tp", "1"]])
def test_a_vocabulary_re_padded_for_another_tp_is_never_materialised_whole(target, materialised, tmp_path):
    """LLaVA's 101-row tables, padded to 256 rows for TP 2 and re-padded to 128 for TP 1 on a
    re-layout: the real rows go out as views of the TP parts and the zero rows as their own piece."""
    src = save_hf("llava", tmp_path / "hf", seed=4)
    tables = [tuple(t.shape) for k, t in load_safetensors_state_dict(src).items()
              if k.endswith(("embed_tokens.weight", "lm_head.weight"))]
    tp2, relaid, back = tmp_path / "tp2", tmp_path / "relaid", tmp_path / "back"
    assert run("convert", "--family", "llava", "--src", src, "--dst", tp2, "--to", "mcore",
               "--format", "legacy", "--tp", 2, "--quiet") == 0
    materialised.clear()
    assert run("convert", "--src", tp2, "--dst", relaid, "--to", "mcore", *target, "--quiet") == 0
    whole = [s for s in materialised if len(s) == 2 and any(s[1] == cols and s[0] >= rows for rows, cols in tables)]
    assert not whole, f"a vocabulary table joined or padded whole on the re-layout: {whole}"
    assert run("convert", "--src", relaid, "--dst", back, "--to", "hf", "--quiet") == 0
    assert_same_checkpoint(back, src)
