"""Fault injection: launcher variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) that
are partial, wrong or name ranks that never come, as a Kubernetes job or a Slurm allocation leaves
them. The contract: exit 2 with one line naming the variable or the missing rank, no traceback, and
never a hang (every rendezvous and collective waits MMPARITY_TIMEOUT seconds, short here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmparity.parallel import runtime
from mmparity.parallel.runtime import free_port
from tests.faults.test_faults import one_line_error

pytestmark = pytest.mark.fault

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = "3"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                 "MMPARITY_TIMEOUT")


def run_subprocess(*argv, env=None, timeout=180):
    """`python -m mmparity ARGV` in a child with exactly the launcher variables in ``env``; a hang
    becomes a test failure, not a stuck suite."""
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    full_env.update({"PYTHONPATH": str(REPO), "MMPARITY_TIMEOUT": TIMEOUT, **(env or {})})
    try:
        proc = subprocess.run([sys.executable, "-m", "mmparity", *map(str, argv)], capture_output=True, text=True,
                              timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mmparity {' '.join(map(str, argv))} hung for {timeout}s")
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def torch_dist_checkpoint(tmp_path_factory):
    from mmparity.models import registry as families
    from mmparity.models.core.inputs import random_like_state
    from mmparity.cli.main import main

    fam = families.get("clip")
    model = fam.build_reference(fam.tiny_config())
    model.load_state_dict(random_like_state(model.state_dict(), seed=3))
    base = tmp_path_factory.mktemp("launcher")
    model.save_pretrained(base / "hf")
    assert main(["convert", "--family", "clip", "--src", str(base / "hf"), "--dst", str(base / "dist"),
                 "--to", "mcore", "--quiet"]) == 0
    return base


# --------------------------------------------------------------------------------------------------
# the variables themselves, checked in-process (no child needed)

BAD_ENVS = {
    "RANK alone": ({"RANK": "0"}, "WORLD_SIZE is not"),
    "WORLD_SIZE alone": ({"WORLD_SIZE": "2"}, "RANK is not"),
    "WORLD_SIZE not an integer": ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    "RANK not an integer": ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK='zero'"),
    "RANK negative": ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1"),
    "RANK too large": ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5"),
    "WORLD_SIZE zero": ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    "LOCAL_RANK not an integer": ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    "no MASTER_ADDR": ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),
    "no MASTER_PORT": ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
    "MASTER_PORT out of range": ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"},
                                 "MASTER_PORT='99999'"),
    "MASTER_PORT not a number": ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"},
                                 "MASTER_PORT='http'"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENVS))
def test_a_partial_or_inconsistent_launcher_environment_is_named(monkeypatch, case):
    env, needle = BAD_ENVS[case]
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(runtime.LaunchError) as info:
        runtime.launch_env()
    message = str(info.value)
    assert needle in message and "\n" not in message
    assert "unset" in message  # says what to unset


def test_a_consistent_environment_is_read_as_torchrun_sets_it(monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    assert runtime.launch_env() == runtime.LaunchEnv(1, 2, 1, "127.0.0.1", 29500, True, "GROUP_RANK=3")
    assert runtime.launched_world_size() == 2


def test_the_timeout_comes_from_mmparity_timeout_or_the_option(monkeypatch):
    monkeypatch.delenv("MMPARITY_TIMEOUT", raising=False)
    assert runtime.timeout_s() == runtime.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("MMPARITY_TIMEOUT", "7.5")
    assert runtime.timeout_s() == 7.5
    runtime.set_timeout(2)
    try:
        assert runtime.timeout_s() == 2
    finally:
        runtime.set_timeout(None)
    monkeypatch.setenv("MMPARITY_TIMEOUT", "soon")
    with pytest.raises(runtime.LaunchError, match="MMPARITY_TIMEOUT='soon'"):
        runtime.timeout_s()


def test_a_timeout_option_that_is_no_duration_is_a_usage_error(capsys):
    from mmparity.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["check", "clip", "--timeout", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout" in err and "above 0" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------------
# the commands, in a child each: inputs that must neither hang nor print a traceback


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
], ids=["partial", "not an integer"])
@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_check_under_a_broken_launcher_environment(env, needle):
    one_line_error(*run_subprocess("check", "clip", "--no-components", env=env), needle, "unset")


@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_check_with_a_rank_out_of_range():
    env = {"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    one_line_error(*run_subprocess("check", "clip", "--no-components", env=env), "RANK=5", "WORLD_SIZE=2")


@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_verify_load_without_master_addr(torch_dist_checkpoint):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": str(free_port())}
    one_line_error(*run_subprocess("verify", "--load", torch_dist_checkpoint / "dist", env=env), "MASTER_ADDR")


@pytest.mark.parametrize("rank, missing", [("0", "rank 1 of 2 never joined"), ("1", "rank 0, which hosts the store")])
def test_convert_as_one_rank_of_two_that_never_met(torch_dist_checkpoint, tmp_path, rank, missing):
    """Stray launcher variables (or a rank that never starts): convert is one rank of two, waits
    for the other, names it, and writes nothing."""
    env = {"RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    line = one_line_error(*run_subprocess("convert", "--family", "clip", "--src", torch_dist_checkpoint / "hf",
                                          "--dst", tmp_path / "out", "--to", "mcore", env=env),
                          "timed out", missing, "unset them to run as one process")
    assert "Traceback" not in line and not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == []


def test_convert_with_workers_under_a_launcher_is_refused(torch_dist_checkpoint, tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    one_line_error(*run_subprocess("convert", "--family", "clip", "--src", torch_dist_checkpoint / "hf",
                                   "--dst", tmp_path / "out", "--to", "mcore", "--workers", "2", env=env),
                   "--workers 2 starts its own ranks", "rank 0 of WORLD_SIZE=2")
    assert not (tmp_path / "out").exists()


def test_check_tp2_when_the_other_rank_never_comes():
    # A launcher environment of world size 2 and --tp 2: this process is rank 0 of a torchrun-style
    # launch, so it waits for rank 1, then names it (the option's timeout, not the environment's).
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "MMPARITY_TIMEOUT": "600"}
    started = time.monotonic()
    line = one_line_error(*run_subprocess("--timeout", TIMEOUT, "check", "clip", "--tp", "2", env=env),
                          f"127.0.0.1:{port}", f"after {TIMEOUT} s", "rank 1 of 2 never joined", "RANK/WORLD_SIZE")
    assert time.monotonic() - started < 150, line


@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_verify_load_when_rank_0_never_comes(torch_dist_checkpoint):
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    one_line_error(*run_subprocess("verify", "--load", torch_dist_checkpoint / "dist", env=env),
                   "timed out", "rank 0")


@pytest.mark.slow  # several seconds: the full suite runs it, the quick loops skip it
def test_world_size_1_without_master_addr_runs_as_one_process():
    code, out, err = run_subprocess("check", "clip", "--no-components", "--quiet", env={"RANK": "0", "WORLD_SIZE": "1"})
    assert code == 0, err
    assert "Traceback" not in err


# --------------------------------------------------------------------------------------------------
# spawned ranks (--tp N, verify --load): one line per failed rank, and their rendezvous times out


class _Inner(ValueError):
    pass


def _fail_nested(rank: int, world_size: int) -> None:
    if rank == 1:
        try:
            raise _Inner("the root cause\nover two lines")
        except _Inner as exc:
            raise RuntimeError("wrapped") from exc
    time.sleep(30)  # stopped by spawn once rank 1 fails


def _never_joins(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(30)  # stopped by spawn once rank 0 gives up
    runtime.init_parallel(world_size, 1)


@pytest.mark.slow
def test_a_spawned_rank_fails_in_one_line_cause_first():
    with pytest.raises(runtime.SpawnError) as info:
        runtime.spawn(_fail_nested, 2)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message and 'File "' not in message
    assert info.value.failures == ["rank 1: _Inner: the root cause over two lines (raised as RuntimeError: wrapped)"]


@pytest.mark.slow
def test_spawned_ranks_that_do_not_meet_time_out_naming_the_missing_rank():
    runtime.set_timeout(2)
    try:
        with pytest.raises(runtime.LaunchError) as info:
            runtime.spawn(_never_joins, 2)
    finally:
        runtime.set_timeout(None)
    message = str(info.value)
    assert message.startswith("spawned rank 0: rendezvous at 127.0.0.1:"), message
    assert "rank 1 of 2 never joined" in message and "RANK/WORLD_SIZE" not in message


def test_a_rank_s_node_is_the_launcher_s_node_number_else_the_host(monkeypatch):
    import socket

    for name in ("GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    assert runtime.node_name() == f"host {socket.gethostname()}"
    monkeypatch.setenv("SLURM_NODEID", "5")
    assert runtime.node_name() == "SLURM_NODEID=5"
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's, under Slurm too
    assert runtime.node_name() == "GROUP_RANK=1"
