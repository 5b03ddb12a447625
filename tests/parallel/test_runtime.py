"""runtime: process groups come and go cleanly, and spawned ranks hand tensors back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmparity.parallel import runtime


def _leave_parallel_state():
    if runtime.current_layout() is not None:
        runtime.teardown_parallel()
    assert not dist.is_initialized()


def test_process_group_is_made_for_the_block_and_a_new_one_can_follow_at_once():
    _leave_parallel_state()
    with runtime.process_group():
        assert dist.is_initialized() and dist.get_world_size() == 1
        gathered = [None]
        dist.all_gather_object(gathered, "here")
        assert gathered == ["here"]
    assert not dist.is_initialized()
    # The old groups may still be being freed in the background: a new layout must not care.
    with runtime.parallel_context(1, 1):
        assert dist.is_initialized()
        with runtime.process_group():  # an existing group is used, not replaced or destroyed
            assert runtime.current_layout() is not None
        assert dist.is_initialized()
    assert not dist.is_initialized()
    for thread in threading.enumerate():
        if thread.name == "mmparity-free-groups":
            thread.join(timeout=30)
            assert not thread.is_alive()


def _return_tensors(rank: int, world_size: int, count: int) -> list[torch.Tensor]:
    runtime.init_parallel(world_size, 1)  # as a check rank does; spawn's teardown then frees it
    return [torch.full((7,), float(rank * count + i)) for i in range(count)]


def test_parallel_state_is_made_from_a_grid_and_describes_itself_as_one():
    from mmparity.parallel.axes import Grid

    _leave_parallel_state()
    with runtime.parallel_context(Grid.of()) as layout:
        assert layout.grid == Grid.of() and (layout.tp, layout.pp, layout.ep) == (1, 1, 1)
        # The same grid given as integers reuses the groups.
        assert runtime.init_parallel(1, 1, ep=1) is runtime.current_layout()
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="must not be given beside it"):
        runtime.init_parallel(Grid.of(), 2)
    with pytest.raises(ValueError, match="tensor-parallel size must be a positive integer, got 0"):
        runtime.init_parallel(0)
    assert runtime.current_layout() is None


@pytest.mark.slow
def test_spawned_ranks_hand_back_tensors_that_live_in_their_memory():
    # torch's queue sends each tensor as a handle that the sending process serves; the parent
    # fetches them one by one while unpickling, so a rank that exits right after sending loses
    # the later ones (FileNotFoundError in the parent). Many tensors make that window wide.
    count = 300
    results = runtime.spawn(_return_tensors, 2, count)
    for rank, tensors in enumerate(results):
        assert [t[0].item() for t in tensors] == [float(rank * count + i) for i in range(count)]


def _environment_and_directory(rank: int, world_size: int) -> tuple:
    return os.environ.get("MMPARITY_TEST_MARK"), os.getcwd(), rank


@pytest.mark.slow
@pytest.mark.parametrize("start", ["spawned", "forked from the shared server"])
def test_ranks_see_the_environment_and_directory_of_the_call(start, monkeypatch, tmp_path):
    # A forked rank's server started earlier, in whatever environment and directory the process
    # had then: what the ranks see must be the caller's at this call, as a spawned rank's is.
    if start == "spawned":
        monkeypatch.setattr(runtime, "_shared_imports", None)
    else:
        monkeypatch.setattr(runtime, "_shared_imports", runtime._shared_imports or ("torch",))
    monkeypatch.delenv("MMPARITY_TEST_MARK", raising=False)
    assert runtime.spawn(_environment_and_directory, 2)[0][0] is None  # the server, if any, is up now
    monkeypatch.setenv("MMPARITY_TEST_MARK", "at the call")
    monkeypatch.chdir(tmp_path)
    assert runtime.spawn(_environment_and_directory, 2) == [("at the call", str(tmp_path), 0),
                                                            ("at the call", str(tmp_path), 1)]


@pytest.mark.slow
def test_torchrun_ranks_meet_on_the_agents_store():
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True): every rank is a client
    # of it, and the check runs in-process on each of its two ranks.
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(repo), MMPARITY_TIMEOUT="60")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(runtime.free_port()), "-m", "mmparity", "check", "clip", "--tp", "2",
                           "--no-components", "--quiet"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_a_free_port_is_chosen_below_the_ephemeral_range_and_never_a_bound_one(monkeypatch):
    import socket

    first = 40000
    monkeypatch.setattr(runtime, "_ephemeral_ports", lambda: (first, 60999))
    for _ in range(20):
        assert first - runtime._PORT_WINDOW <= runtime.free_port() < first
    # A window of two ports, one of them held by a listener: the other every time.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        window = (taken, taken + 1) if taken % 2 else (taken - 1, taken)
        other = window[0] if window[1] == taken else window[1]
        if not runtime._bindable("127.0.0.1", other):
            pytest.skip(f"port {other} beside the held one is in use on this machine")
        monkeypatch.setattr(runtime, "_PORT_WINDOW", 2)
        monkeypatch.setattr(runtime, "_ephemeral_ports", lambda: (window[1] + 1, 60999))
        assert {runtime.free_port() for _ in range(20)} == {other}


def test_a_free_port_is_the_kernels_pick_where_no_range_or_no_room_below_it(monkeypatch):
    for span in (None, (1024, 65535)):
        monkeypatch.setattr(runtime, "_ephemeral_ports", lambda: span)
        port = runtime.free_port()
        assert runtime._bindable("127.0.0.1", port)
    # Every port of the window taken: the kernel's pick, not a hang or an error.
    monkeypatch.setattr(runtime, "_ephemeral_ports", lambda: (40000, 60999))
    monkeypatch.setattr(runtime, "_bindable", lambda host, port: False)
    assert runtime.free_port() > 0


def test_the_ephemeral_range_is_read_from_the_kernel_where_it_is_there():
    span = runtime._ephemeral_ports()
    if not os.path.exists(runtime.EPHEMERAL_RANGE_FILE):
        assert span is None
    else:
        assert span is not None and 0 < span[0] <= span[1] <= 65535


class _Clock:
    """time.monotonic and time.sleep of runtime, moved by hand: pauses are asserted, not timed."""

    def __init__(self):
        self.now, self.slept = 100.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_poll_pace_starts_short_grows_with_the_wait_and_stops_at_its_longest(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runtime.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(runtime.time, "sleep", clock.sleep)
    pace = runtime.PollPace(0.02)
    for _ in range(400):
        pace.pause()
    first, longest = clock.slept[0], max(clock.slept)
    assert first == pytest.approx(0.0005)  # a key set just after the first look is seen at once
    assert longest == pytest.approx(0.02)
    assert clock.slept == sorted(clock.slept)
    for done, pause in zip(_running_sums(clock.slept), clock.slept[1:]):
        # Never more than a tenth of the wait so far (past the shortest pause).
        assert pause <= max(0.0005, done / 10) + 1e-12


def test_poll_pace_never_sleeps_past_a_deadline(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runtime.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(runtime.time, "sleep", clock.sleep)
    pace = runtime.PollPace(1.0)
    clock.now += 50.0  # a wait grown long: its pause would be the longest
    pace.pause(deadline=clock.now + 0.003)
    pace.pause(deadline=clock.now - 1.0)
    assert clock.slept == [pytest.approx(0.003), 0.0]


def _running_sums(values):
    total = 0.0
    for value in values:
        total += value
        yield total


class _LateKeyStore:
    """A store in which ``done/1`` appears at a set time of the fake clock; counts its calls."""

    def __init__(self, clock, key_at):
        self.clock, self.key_at, self.calls = clock, key_at, []

    def check(self, keys):
        self.calls.append(keys[0] if len(keys) == 1 else tuple(keys))
        return all(k.startswith("done/") for k in keys) and self.clock.now >= self.key_at

    def get(self, key):
        self.calls.append(key)
        return b"1"


def _team_on(store):
    from mmparity.io.team import _StoreTeam

    team = object.__new__(_StoreTeam)
    team.rank, team.size, team._timeout = 0, 2, 60.0
    team._store, team._seen, team._heard_failure = store, {}, False
    return team


def test_a_rank_sees_a_key_within_a_millisecond_of_its_setting_early_in_a_wait(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runtime.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(runtime.time, "sleep", clock.sleep)
    store = _LateKeyStore(clock, key_at=clock.now + 0.0012)
    assert _team_on(store)._wait([1], "done", "testing") == {1: b"1"}
    # A fixed 20 ms pause would have put the whole pause on this hand-off.
    assert clock.now - store.key_at < 0.001


def test_a_long_wait_looks_at_the_others_liveness_no_oftener_than_before(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runtime.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(runtime.time, "sleep", clock.sleep)
    store = _LateKeyStore(clock, key_at=clock.now + 2.0)
    _team_on(store)._wait([1], "done", "testing")
    liveness_looks = store.calls.count("failed/1")
    # At most once per 20 ms, as before; and still often enough to notice a dead rank.
    assert 2.0 / 0.05 <= liveness_looks <= 2.0 / 0.02 + 1
    assert store.calls.count("done/1") < 2.0 / 0.02 + 60  # the fast start adds a few dozen looks, not thousands


def test_a_wait_for_many_ranks_asks_the_store_once_per_look_not_once_per_rank(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runtime.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(runtime.time, "sleep", clock.sleep)
    store = _LateKeyStore(clock, key_at=clock.now + 0.5)
    team = _team_on(store)
    team.size = 64
    got = team._wait(range(1, 64), "done", "testing")
    assert sorted(got) == list(range(1, 64))
    looks = [c for c in store.calls if isinstance(c, tuple)]
    one_by_one = [c for c in store.calls if isinstance(c, str) and c.startswith("done/")]
    # The pace's looks are one call each; rank-by-rank calls come on the liveness period only.
    assert len(looks) >= 30 and all(len(c) == 63 for c in looks)
    assert len(one_by_one) <= 63 * (0.5 / 0.02 + 2) + 63
