"""The live-model API when one rank fails alone: every rank raises the same error, none waits.

``import_hf`` and ``export_hf`` are collective. What a rank does alone before a collective (read
the checkpoint's config and headers, open the base, take its own module) can fail on that rank
only: its own unreadable path, a file another node sees differently, a model list of the wrong
length. Unless the ranks agree on problems before anyone waits on data, the others sit in the
collective until the process group's timeout (Megatron-LM's default: 10 minutes) and end with
gloo's error instead of the one that names the cause. Here the timeout is short (a regression
shows as gloo's error, not as a stuck suite), and every rank must raise the same error naming the
failing rank and its file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.megatron import live

from tests.mapping.test_convert_roundtrips import save_hf

pytestmark = [pytest.mark.fault, pytest.mark.slow]  # spawns gloo ranks


def _rank(rank: int, world: int, hf_dir: str, bad: str, case: str):
    from mmparity.models.core import megatron_classes as models

    runtime.init_parallel(world, 1, seed=5)
    cfg = live.family_config(hf_dir, "clip")
    model = models.build(families.get("clip").megatron_class()[1].build, cfg)
    mine = bad if rank == 1 else hf_dir
    try:
        if case == "import_hf, rank 1's directory is missing" or case == "import_hf, rank 1's header is garbage":
            live.import_hf(model, mine, "clip")
        elif case == "export_hf, rank 1's base is missing":
            dict(live.export_hf(model, "clip", cfg, base=mine))
        elif case == "import_hf, rank 1 passes two model chunks":
            live.import_hf([model, model] if rank == 1 else model, hf_dir, "clip")
        elif case == "all ranks see the same missing directory":
            live.import_hf(model, bad, "clip")
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.fixture(scope="module")
def clip_release(tmp_path_factory):
    return save_hf("clip", tmp_path_factory.mktemp("live-faults") / "clip", seed=4)


def _bad(case: str, release: Path, tmp_path: Path) -> Path:
    if "garbage" in case:
        bad = tmp_path / "garbage"
        shutil.copytree(release, bad)
        shard = sorted(bad.glob("*.safetensors"))[0]
        shard.write_bytes((2**40).to_bytes(8, "little") + b"{not json")
        return bad
    return tmp_path / "not-here"


CASES = ["import_hf, rank 1's directory is missing", "import_hf, rank 1's header is garbage",
         "export_hf, rank 1's base is missing", "import_hf, rank 1 passes two model chunks"]


@pytest.mark.parametrize("case", CASES)
def test_one_rank_failing_alone_fails_every_rank_alike(clip_release, tmp_path, monkeypatch, case):
    monkeypatch.setenv(runtime.TIMEOUT_ENV, "20")
    bad = _bad(case, clip_release, tmp_path)
    results = runtime.spawn(_rank, 2, str(clip_release), str(bad), case)
    assert all(r is not None for r in results), results
    assert len(set(results)) == 1, results  # the same error on both ranks
    (kind, message), = set(results)
    assert kind == "ConversionError", message
    assert "rank 1" in message and "rank 0:" not in message, message
    if "chunks" in case:
        assert "model chunk" in message, message
    else:
        assert str(bad) in message, message


def test_a_failure_every_rank_shares_is_raised_as_it_is(clip_release, tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.TIMEOUT_ENV, "20")
    bad = tmp_path / "not-here"
    results = runtime.spawn(_rank, 2, str(clip_release), str(bad), "all ranks see the same missing directory")
    assert len(set(results)) == 1, results
    (kind, message), = set(results)
    assert kind != "ConversionError" and str(bad) in message, results
