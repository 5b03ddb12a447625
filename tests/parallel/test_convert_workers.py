"""``convert`` on several processes (``--workers P``, or torchrun-style ranks): the same bytes as one
process, each rank writing whole output files, and a rank that dies at any point leaves the
destination as it was, with the rank named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmparity.io.team import assign_units
from mmparity.parallel.runtime import free_port
from tests.faults.test_faults_launcher import run_subprocess

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # every conversion here starts 2-3 interpreters


def mmparity(*argv, env=None, timeout=180):
    # A longer timeout than the launcher tests': these ranks really convert, on a loaded machine.
    return run_subprocess(*argv, env={"MMPARITY_TIMEOUT": "20", **(env or {})}, timeout=timeout)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_tree(a: Path, b: Path) -> None:
    ta, tb = tree_bytes(a), tree_bytes(b)
    assert sorted(ta) == sorted(tb)
    assert [name for name in ta if ta[name] != tb[name]] == []


def test_units_are_assigned_by_bytes_deterministically():
    assert assign_units([5, 1, 1, 1, 1, 1], 2) == (0, 1, 1, 1, 1, 1)
    assert assign_units([3, 3, 3], 2) == (0, 1, 0)
    assert assign_units([1, 2], 3) == (1, 0)  # a rank may have nothing to write
    sizes = [7, 3, 9, 1, 4, 4, 8]
    owners = assign_units(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes) and assign_units(sizes, 3) == owners


@pytest.fixture(scope="module")
def kimi_hf(tmp_path_factory):
    """The tiny whole Kimi-K2.5 (MLA + MoE language model, MoonViT tower), seeded, in many shards."""
    from mmparity.models import registry as families
    from mmparity.models.core.inputs import random_like_state
    from mmparity.io.fsio.safetensors_write import save_safetensors_checkpoint

    family = families.get("kimi_k25_vl")
    cfg = family.tiny_config()
    path = tmp_path_factory.mktemp("kimi") / "hf"
    save_safetensors_checkpoint(path, random_like_state(family.build_reference(cfg).state_dict(), seed=5),
                                max_shard_size="40KB", extra_files={"config.json": cfg.to_json_string()})
    return path


# (what, convert arguments); each also goes back to HF from what it wrote, on the same process counts.
TARGETS = {
    "torch_dist": ["--to", "mcore", "--max-shard-size", "60KB"],
    "legacy tp2 ep2": ["--to", "mcore", "--format", "legacy", "--tp", "2", "--ep", "2"],
    "legacy pp2 ep2 sequential": ["--to", "mcore", "--format", "legacy", "--pp", "2", "--ep", "2",
                                  "--expert-layout", "sequential"],
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_several_processes_write_the_bytes_one_process_writes(kimi_hf, tmp_path, target):
    written = {}
    for workers in (1, 2, 3):
        mcore, back = tmp_path / f"mcore{workers}", tmp_path / f"back{workers}"
        code, out, err = mmparity("convert", "--src", kimi_hf, "--dst", mcore, *TARGETS[target],
                                  "--workers", workers)
        assert code == 0, err
        if workers > 1:
            assert f"by {workers} processes" in out
        # From one source for all (the manifest records the source's path).
        code, out, err = mmparity("convert", "--src", tmp_path / "mcore1", "--dst", back, "--to", "hf",
                                  "--max-shard-size", "30KB", "--workers", workers)
        assert code == 0, err
        written[workers] = mcore, back
    for workers in (2, 3):
        assert_same_tree(written[1][0], written[workers][0])
        assert_same_tree(written[1][1], written[workers][1])
    files = [p for p in written[1][0].rglob("*") if p.name.endswith((".distcp", ".pt")) and p.name != "common.pt"]
    assert len(files) >= 3, "too few units to share between the ranks"
    assert len(list(written[1][1].glob("*.safetensors"))) >= 3
    code, out, err = mmparity("verify", written[3][0])
    assert code == 0, err


@pytest.fixture(scope="module")
def old_destination(kimi_hf, tmp_path_factory):
    """A complete checkpoint at the destination that every killed run must leave as it was."""
    path = tmp_path_factory.mktemp("old") / "dst"
    code, _, err = mmparity("convert", "--src", kimi_hf, "--dst", path, "--to", "mcore", "--max-shard-size", "60KB")
    assert code == 0, err
    return path


# (rank killed, fault point): the first tensor, a later one, rank 0 right after creating the
# staging directory and right before publishing it, rank 1 after sending its records.
KILLS = [("0", "staged"), ("0", "tensor"), ("1", "tensor"), ("1", "7"), ("0", "12"), ("0", "synced")]


@pytest.mark.fault
@pytest.mark.parametrize("rank, point", KILLS)
def test_a_killed_rank_fails_the_conversion_and_leaves_the_destination(kimi_hf, old_destination, rank, point):
    before = tree_bytes(old_destination)
    parent = old_destination.parent
    litter = sorted(os.listdir(parent))
    code, out, err = mmparity("convert", "--src", kimi_hf, "--dst", old_destination, "--to", "mcore", "--force",
                              "--max-shard-size", "60KB", "--dtype", "bfloat16", "--workers", "2",
                              env={"MMPARITY_FAULT": f"kill@{point}", "MMPARITY_FAULT_RANK": rank})
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (out, err)
    assert len(lines) == 1 and f"rank {rank} was killed by SIGKILL" in lines[0], err
    assert "Traceback" not in err
    assert tree_bytes(old_destination) == before
    assert sorted(os.listdir(parent)) == litter  # no staging directory left behind


def _start_rank(rank: int, world: int, port: int, argv, env=None, cwd=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    full_env.update({"PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MMPARITY_TIMEOUT": "8", **(env or {})})
    return subprocess.Popen([sys.executable, "-m", "mmparity", *map(str, argv)], env=full_env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.fault
@pytest.mark.parametrize("killed, survivor_says", [
    (1, "rank 1 of 2 stopped answering"),
    (0, "rank 0 of 2, which hosts the ranks' store, went away"),
])
def test_launcher_ranks_name_the_rank_that_died(kimi_hf, tmp_path, killed, survivor_says):
    """Ranks as torchrun starts them (no --workers parent watching): the survivor notices a rank
    killed mid-write by itself, within the timeout, names it, and nothing is published."""
    dst = tmp_path / "out"
    argv = ["convert", "--src", kimi_hf, "--dst", dst, "--to", "mcore", "--max-shard-size", "60KB"]
    port = free_port()
    procs = [_start_rank(r, 2, port, argv, env={"MMPARITY_FAULT": "pause@tensor", "MMPARITY_FAULT_RANK": str(killed)})
             for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        survivor = procs[1 - killed]
        # Both ranks met once rank 0's staging directory exists; the paused one stops at its first
        # tensor, the other writes its share and waits for it.
        while not any(name.startswith(".out.tmp-") for name in os.listdir(tmp_path)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the ranks never met"
            time.sleep(0.05)
        time.sleep(1)
        procs[killed].send_signal(signal.SIGKILL)
        out, err = survivor.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert survivor.returncode == 2, err
    assert len(lines) == 1 and survivor_says in lines[0] and "Traceback" not in err, err
    assert not dst.exists()
    if killed == 1:  # rank 0 removed its staging directory; a killed rank 0 leaves it to the next run
        assert sorted(os.listdir(tmp_path)) == []
    code, _, err = mmparity("convert", "--src", kimi_hf, "--dst", dst, "--to", "mcore")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_two_torchrun_nodes_on_localhost_write_the_bytes_one_process_writes(kimi_hf, tmp_path):
    """Two torchrun "nodes" (agents) of two ranks each, meeting on localhost, on one shared
    filesystem: torchrun's agent hosts the store, the four ranks share the files out."""
    single = tmp_path / "single"
    code, _, err = mmparity("convert", "--src", kimi_hf, "--dst", single, "--to", "mcore", "--max-shard-size", "60KB")
    assert code == 0, err
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), MMPARITY_TIMEOUT="30")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "mmparity", "convert", "--src", str(kimi_hf), "--dst", str(tmp_path / "out"),
                               "--to", "mcore", "--max-shard-size", "60KB"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in range(2)]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "by 4 processes" in outputs[0][0]
    assert_same_tree(single, tmp_path / "out")


def _gathered(nodes: list[Path], into: Path) -> Path:
    """The nodes' directories copied into one, as a user gathers a node-local checkpoint."""
    for node in nodes:
        for path in sorted(node.rglob("*")):
            if path.is_file():
                target = into / path.relative_to(node)
                assert not target.exists(), f"{path}: written on two nodes"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
    return into


def test_two_torchrun_nodes_with_node_local_destinations_write_one_process_bytes_between_them(kimi_hf, tmp_path):
    """``--node-local``: two torchrun "nodes" whose ``--dst out`` is relative to different
    directories, as on machines without a shared filesystem. Each node holds its ranks' data files;
    rank 0's node also the metadata; the two gathered are the one-process checkpoint, byte for byte."""
    single = tmp_path / "single"
    code, _, err = mmparity("convert", "--src", kimi_hf, "--dst", single, "--to", "mcore", "--max-shard-size", "60KB")
    assert code == 0, err
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), MMPARITY_TIMEOUT="30")
    disks = [tmp_path / f"node{node}" for node in range(2)]
    for disk in disks:
        disk.mkdir()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "mmparity", "convert", "--src", str(kimi_hf), "--dst", "out", "--node-local",
                               "--to", "mcore", "--max-shard-size", "60KB"],
                              env=env, cwd=disks[node], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in range(2)]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    held = [sorted(tree_bytes(disk / "out")) for disk in disks]
    assert held[1] and all(name.endswith(".distcp") for name in held[1]), held  # data files only
    assert any(name.endswith(".metadata") for name in held[0])
    assert sorted(held[0] + held[1]) == sorted(tree_bytes(single))
    code, out, _ = mmparity("verify", disks[0] / "out")  # not gathered: says so, and how
    assert code != 0 and "data file is missing (written on another node with convert --node-local?" in out
    merged = _gathered([disk / "out" for disk in disks], tmp_path / "merged")
    assert_same_tree(single, merged)
    code, _, err = mmparity("verify", merged)
    assert code == 0, err
    assert sorted(os.listdir(disks[1])) == ["out"]  # no staging directory left on either node


def _node_local_ranks(kimi_hf, tmp_path, dst_of_node, env=None):
    """Four launcher-started ranks, two per "node" (GROUP_RANK, as torchrun sets it), each node in
    its own working directory; returns (disks, [(returncode, stderr)])."""
    disks = [tmp_path / f"node{node}" for node in range(2)]
    for disk in disks:
        disk.mkdir(exist_ok=True)
    port = free_port()
    procs = [_start_rank(r, 4, port, ["convert", "--src", kimi_hf, "--dst", dst_of_node(disks[r // 2]),
                                      "--node-local", "--to", "mcore", "--max-shard-size", "60KB"],
                         env={"GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2), **(env or {})}, cwd=disks[r // 2])
             for r in range(4)]
    try:
        results = [(proc.wait(timeout=120), proc.stderr.read()) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
    return disks, results


@pytest.mark.fault
def test_node_local_ranks_killed_before_their_node_publishes_publish_nothing(kimi_hf, tmp_path):
    """Node 1's first rank (rank 2) killed when told to publish: rank 0 has written the metadata but
    waits for it, names it, and publishes nothing; no node's destination appears."""
    disks, results = _node_local_ranks(kimi_hf, tmp_path, lambda disk: "out",
                                       env={"MMPARITY_FAULT": "kill@node-publish", "MMPARITY_FAULT_RANK": "2"})
    assert results[2][0] == -signal.SIGKILL
    code, err = results[0]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "rank 2 of 4" in lines[0] and "Traceback" not in err, err
    assert not (disks[0] / "out").exists() and not (disks[1] / "out").exists()
    assert os.listdir(disks[0]) == []  # rank 0 removed its staging directory
    # The killed rank's staging directory is removed by the next conversion on that node.
    code, _, err = mmparity("convert", "--src", kimi_hf, "--dst", disks[1] / "out", "--to", "mcore")
    assert code == 0, err
    assert sorted(os.listdir(disks[1])) == ["out"]


def test_node_local_refuses_a_destination_the_nodes_share(kimi_hf, tmp_path):
    shared = tmp_path / "shared" / "out"
    disks, results = _node_local_ranks(kimi_hf, tmp_path, lambda disk: shared)
    assert all(code == 2 for code, _ in results), results
    lines = [line for line in results[0][1].splitlines() if line.strip()]
    assert len(lines) == 1 and "shared filesystem; drop --node-local" in lines[0], results[0][1]
    assert not shared.exists() and (not shared.parent.exists() or os.listdir(shared.parent) == [])


def test_node_local_is_refused_for_formats_read_from_one_directory(kimi_hf, tmp_path):
    for extra in (["--to", "hf"], ["--to", "mcore", "--format", "legacy"]):
        code, out, err = mmparity("convert", "--src", kimi_hf, "--dst", tmp_path / "x", "--node-local", *extra)
        assert code == 2 and "--node-local applies to --to mcore --format torch_dist" in err and "Traceback" not in err
