"""Several processes writing one checkpoint together (``torchrun ... -m mmparity convert``, or
``convert --workers P``): which output units each writes, how they meet, and the one staging
directory they share and publish once.

Every rank plans the whole conversion (the plan is a pure function of the source), so each knows
every output unit (an HF shard, a legacy rank file, a torch_dist ``.distcp`` file) and who writes
it (:func:`assign_units`) without asking anyone. Rank 0 creates the staging directory beside the
destination (a shared filesystem), the ranks fill their units there and fsync them, rank 0
collects their manifest records, writes the small files (index, ``.metadata``, manifest) and
publishes, exactly as one process would: the output does not depend on how many processes wrote
it.

The ranks talk through torch.distributed's TCP store (no process group, no pickle: payloads are
JSON). A rank that fails says so in the store before it leaves, and the others stop with its
message; a rank that dies without a word (SIGKILL, a lost node) stops refreshing its heartbeat,
and the others give up after ``runtime.timeout_s()`` naming it. Whatever happens, nothing is
published unless every rank finished, and rank 0 removes the staging directory on any failure
(if rank 0 itself is killed, the next conversion to the same destination removes it, as after a
killed single process).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from mmparity import errors
from mmparity.parallel import runtime
from mmparity.io.fsio import faults, interrupts
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.publish import (
    atomic_directory, discard_staging_directory, make_staging_directory, publish_staging_directory)

__all__ = ["Team", "TeamError", "assign_units", "solo", "join"]

_HEARTBEAT_S = 0.5
_POLL_S = 0.02


class TeamError(CheckpointError):
    """Another rank failed or vanished: one line naming it."""


def assign_units(sizes: Sequence[int], workers: int) -> tuple[int, ...]:
    """The rank that writes each unit, by bytes: largest first to the least-loaded rank (ties to
    the lower unit and rank numbers), so every rank computes the same answer."""
    if workers < 1:
        raise ValueError(f"workers must be positive, got {workers}")
    owners = [0] * len(sizes)
    load = [0] * workers
    for unit in sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)):
        rank = min(range(workers), key=lambda r: (load[r], r))
        owners[unit] = rank
        load[rank] += sizes[unit]
    return tuple(owners)


class Team:
    """One process's place among ``size`` processes writing one checkpoint; the solo team (one
    process) is the default and costs nothing."""

    rank = 0
    size = 1

    @property
    def solo(self) -> bool:
        return self.size == 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def mine(self, sizes: Sequence[int]) -> list[bool]:
        """For each unit of ``sizes`` bytes, whether this rank writes it."""
        return [owner == self.rank for owner in assign_units(sizes, self.size)]

    @contextlib.contextmanager
    def staging(self, destination: str | os.PathLike, *, force: bool = False,
                inner: str | None = None, node_local: bool = False) -> Iterator[Path]:
        """The staging directory every rank writes into (``inner``: a subdirectory rank 0 creates
        before the others may write, e.g. the iteration directory); published by rank 0 once the
        block succeeded on every rank. ``node_local``: ``destination`` names a directory on each
        node's own disk, and each node stages and publishes the files its ranks write there."""
        with atomic_directory(destination, force=force) as staging:
            if inner is not None:
                (staging / inner).mkdir()
            yield staging

    def gather(self, phase: str, payload) -> list | None:
        """Every rank's JSON-able ``payload`` on rank 0 (in rank order), None on the others."""
        return [payload]

    def fail(self, message: str) -> None:
        """Tells the other ranks this one failed (``message``: the user's line), so that they stop
        at once instead of waiting for it; nothing where it only heard of another's failure."""

    def close(self) -> None:
        pass


def solo() -> Team:
    return Team()


class _StoreTeam(Team):
    def __init__(self, env: runtime.LaunchEnv):
        self.rank, self.size = env.rank, env.world_size
        self._env = env
        self._timeout = runtime.timeout_s()
        self._store, self._open_client = runtime.rendezvous_store(env, "convert")
        self._beats = 0
        self._heard_failure = False
        self._stop = threading.Event()
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._beat_thread = threading.Thread(target=self._heartbeat, args=(self._open_client(),),
                                             name="mmparity-heartbeat", daemon=True)
        self._beat_thread.start()

    # -- the store ----------------------------------------------------------------------------

    def _heartbeat(self, client) -> None:
        # Its own client: the main thread may sit in a long store call or none at all.
        while not self._stop.is_set():
            self._beats += 1
            with contextlib.suppress(Exception):  # the host is gone: the main thread will say so
                client.set(f"alive/{self.rank}", str(self._beats))
            self._stop.wait(_HEARTBEAT_S)

    def _heard(self, message: str) -> TeamError:
        self._heard_failure = True
        return TeamError(message)

    def _host_gone(self, doing: str) -> TeamError:
        host = ("torchrun's agent, which hosts the ranks' store," if self._env.agent_store
                else f"rank 0 of {self.size}, which hosts the ranks' store,")
        return self._heard(f"{host} went away while {doing} (killed, or its node failed); nothing was published")

    def _call(self, doing: str, fn, *args):
        try:
            return fn(*args)
        except Exception:  # a closed connection: the store's host died
            raise self._host_gone(doing) from None

    def _wait(self, ranks: Sequence[int], key: str, doing: str) -> dict[int, bytes]:
        """``key/<rank>`` of each of ``ranks``, waiting while they are alive."""
        pending = list(ranks)
        got: dict[int, bytes] = {}
        started = time.monotonic()
        pace = runtime.PollPace(_POLL_S)
        checked_others = None

        def take_arrived() -> None:
            for rank in list(pending):
                if self._call(doing, self._store.check, [f"{key}/{rank}"]):
                    got[rank] = self._call(doing, self._store.get, f"{key}/{rank}")
                    pending.remove(rank)

        while pending:
            # One store call asks for every awaited key at once (true when all are there): with
            # many ranks a poll is not a call per rank.
            if self._call(doing, self._store.check, [f"{key}/{rank}" for rank in pending]):
                take_arrived()
                break
            # Which ranks are still to come, and whether they are alive (the others' failure and
            # heartbeat keys, several calls per rank): on the old fixed period, while the awaited
            # keys are looked at as the pace allows.
            now = time.monotonic()
            if checked_others is None or now - checked_others >= _POLL_S:
                if len(pending) > 1:  # (for one, the look just made says it is still to come)
                    take_arrived()
                if not pending:
                    break
                self._check_others(pending, doing, started)
                checked_others = now
            pace.pause()
        return got

    def _check_others(self, ranks: Sequence[int], doing: str, started: float) -> None:
        now = time.monotonic()
        for rank in range(self.size):
            if rank != self.rank and self._call(doing, self._store.check, [f"failed/{rank}"]):
                message = self._call(doing, self._store.get, f"failed/{rank}").decode(errors="replace")
                raise self._heard(f"rank {rank} of {self.size} failed: {message}")
        for rank in ranks:
            beat = (self._call(doing, self._store.get, f"alive/{rank}")
                    if self._call(doing, self._store.check, [f"alive/{rank}"]) else b"")
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)
                last = self._seen[rank]
            if now - max(last[1], started) > self._timeout:
                what = "stopped answering" if beat else "never started converting"
                raise self._heard(f"rank {rank} of {self.size} {what} while {doing} (killed, or its node went "
                                f"away; waited {self._timeout:g} s, {runtime.TIMEOUT_ENV}); nothing was published")

    def fail(self, message: str) -> None:
        if self._heard_failure:
            return
        with contextlib.suppress(Exception):  # the store's host is gone: nobody is left to tell
            self._store.set(f"failed/{self.rank}", message)

    def _say_failed(self, exc: BaseException) -> None:
        self.fail(errors.one_line(exc, 400) if not str(exc) else " ".join(str(exc).split()))

    # -- the protocol -------------------------------------------------------------------------

    def gather(self, phase: str, payload) -> list | None:
        self._call(f"sending its {phase} records", self._store.set, f"{phase}/{self.rank}",
                   json.dumps(payload, separators=(",", ":")))
        if not self.leader:
            faults.fault_point("shared")
            return None
        got = self._wait(range(1, self.size), phase, f"collecting the ranks' {phase} records")
        return [payload] + [json.loads(got[rank]) for rank in range(1, self.size)]

    @contextlib.contextmanager
    def staging(self, destination: str | os.PathLike, *, force: bool = False,
                inner: str | None = None, node_local: bool = False) -> Iterator[Path]:
        if node_local:
            with self._node_local_staging(destination, force=force, inner=inner) as staging:
                yield staging
            return
        created: list[Path] = []
        staging = None
        try:
            if self.leader:
                with interrupts.deferred():  # made and recorded as one step (see make_staging_directory)
                    staging, created = make_staging_directory(destination, force=force)
                faults.fault_point("staged")
                if inner is not None:
                    (staging / inner).mkdir()
                self._store.set("staging/0", str(staging))
            else:
                staging = Path(self._wait([0], "staging", "waiting for rank 0's staging directory")[0].decode())
                if not staging.is_dir():
                    raise TeamError(f"{staging}: rank 0's staging directory is not visible from this rank; "
                                    "every rank must see the destination's filesystem (a shared one across nodes), "
                                    "or pass --node-local (torch_dist) to give each node its own")
            yield staging
            if self.leader:
                publish_staging_directory(staging, destination, force=force)
                self._store.set("published/0", "1")
                # The store lives in this process: the others must have heard before it goes. The
                # checkpoint is out either way, so a rank lost now costs nothing.
                with contextlib.suppress(TeamError):
                    self._wait(range(1, self.size), "done", "waiting for the ranks to hear of the publish")
            else:
                self._wait([0], "published", "waiting for rank 0 to publish")
                self._store.set(f"done/{self.rank}", "1")
        except BaseException as exc:
            try:
                self._say_failed(exc)
            finally:  # also when a second Ctrl-C cuts the message short
                if self.leader and staging is not None:
                    discard_staging_directory(staging, created)
            raise

    @contextlib.contextmanager
    def _node_local_staging(self, destination: str | os.PathLike, *, force: bool,
                            inner: str | None) -> Iterator[Path]:
        """Each node's first rank stages ``destination`` on that node's own disk for the node's
        ranks; rank 0's also gets the small files. Publishing is two-step, rank 0 last: once rank 0
        has written everything, the other nodes publish their data files, then rank 0 publishes
        the directory with ``.metadata``, so a checkpoint whose metadata is out has all its data
        files out on some node. (No rename spans machines: a node lost between the two steps
        leaves the nodes that published holding data files without metadata.)"""
        created: list[Path] = []
        staging = None
        owned = published = False
        try:
            self._call("announcing its node", self._store.set, f"node/{self.rank}", self._env.node)
            others = [r for r in range(self.size) if r != self.rank]
            nodes = {r: v.decode() for r, v in self._wait(others, "node", "learning which node each rank runs on").items()}
            nodes[self.rank] = self._env.node
            node_leaders = sorted({min(r for r in nodes if nodes[r] == node) for node in nodes.values()})
            my_leader = min(r for r in nodes if nodes[r] == self._env.node)
            if self.rank == my_leader:
                with interrupts.deferred():  # made and recorded as one step (see make_staging_directory)
                    staging, created = make_staging_directory(destination, force=force)
                    owned = True
                faults.fault_point("staged")
                if inner is not None:
                    (staging / inner).mkdir()
                self._store.set(f"staging/{self.rank}", str(staging))
                theirs = self._wait([r for r in node_leaders if r != self.rank], "staging",
                                    "waiting for the other nodes' staging directories")
                for rank, path in theirs.items():
                    other = Path(path.decode())
                    with contextlib.suppress(OSError):  # not visible here: node-local indeed
                        if os.path.samefile(other.parent, staging.parent):
                            raise TeamError(
                                f"{Path(destination).absolute()}: --node-local, but rank {rank} on another node "
                                f"({nodes[rank]}) stages into the same directory ({other.parent}): the destination "
                                "is on a shared filesystem; drop --node-local")
            else:
                staging = Path(self._wait([my_leader], "staging",
                                          f"waiting for rank {my_leader}'s staging directory on this node"
                                          )[my_leader].decode())
                if not staging.is_dir():
                    raise TeamError(f"{staging}: rank {my_leader}'s staging directory is not visible from rank "
                                    f"{self.rank}, which the launcher puts on the same node ({self._env.node})")
            yield staging
            if self.leader:
                self._store.set("commit/0", "1")
                self._wait([r for r in node_leaders if r != 0], "published",
                           "waiting for the other nodes to publish their data files")
                publish_staging_directory(staging, destination, force=force)
                published = True
                self._store.set("published/0", "1")
                with contextlib.suppress(TeamError):
                    self._wait(range(1, self.size), "done", "waiting for the ranks to hear of the publish")
            else:
                if self.rank == my_leader:
                    self._wait([0], "commit", "waiting for rank 0 to write the checkpoint's metadata")
                    faults.fault_point("node-publish")
                    publish_staging_directory(staging, destination, force=force)
                    published = True
                    self._store.set(f"published/{self.rank}", "1")
                self._wait([0], "published", "waiting for rank 0 to publish")
                self._store.set(f"done/{self.rank}", "1")
        except BaseException as exc:
            try:
                self._say_failed(exc)
            finally:  # also when a second Ctrl-C cuts the message short
                if owned and not published:
                    discard_staging_directory(staging, created)
            raise

    def close(self) -> None:
        self._stop.set()
        self._beat_thread.join(timeout=5)


def join() -> Team:
    """This process's team: from a launcher's variables (torchrun's, or ``--workers``'), else solo.
    Raises ``runtime.LaunchError`` for partial or inconsistent variables or ranks that never met."""
    env = runtime.launch_env()
    if env is None or env.world_size == 1:
        return solo()
    return _StoreTeam(env)
