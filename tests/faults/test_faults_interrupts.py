"""Ctrl-C at the instant a conversion's staging directory appears leaves nothing behind.

The window: a signal raised between the ``mkdir`` of the staging directory and the statement that
records it for the ``except`` clause that removes it, or halfway through that removal (a second
Ctrl-C). Made deterministic here by raising SIGINT from inside the steps themselves; and tried as a
user does: SIGINT sent the moment the directory shows up, once or again and again until the
command exits, over several runs. Every run: exit 130 (128 + SIGINT, as a shell reports it), one
line, no staging directory, no destination.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from mmparity.io.fsio import interrupts, publish

from tests.faults.test_faults import FAMILY, REPO, as_from_a_terminal, sources  # noqa: F401

pytestmark = pytest.mark.fault


@pytest.fixture(autouse=True)
def _ctrl_c_raises_as_at_a_terminal():
    """These tests raise SIGINT in this process and expect Python's KeyboardInterrupt. A suite
    started as a shell's background job (`.ci/run &` from a script) inherits SIGINT ignored, and the
    interpreter keeps it so: the signal would vanish and each test fail for how it was launched."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_deferred_raises_what_arrived_when_the_block_ends():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the signal")
            with interrupts.deferred():  # nested: held to the outermost block's end
                signal.raise_signal(signal.SIGINT)
                reached.append("inner")
            reached.append("after the inner block")
    assert reached == ["after the signal", "inner", "after the inner block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_leaves_ignored_signals_ignored_and_other_threads_alone():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupts.deferred():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, previous)
    failures = []
    thread = threading.Thread(target=lambda: failures.append(_deferred_off_the_main_thread()))
    thread.start()
    thread.join()
    assert failures == [None]


def _deferred_off_the_main_thread():
    try:
        with interrupts.deferred():
            pass
    except Exception as exc:  # signal.signal would raise off the main thread
        return exc
    return None


def _interrupt_after(target, name: str, monkeypatch) -> None:
    """``target.name`` runs, then SIGINT is raised: the instant after that step."""
    real = getattr(target, name)

    def then_interrupted(*args, **kwargs):
        result = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return result

    monkeypatch.setattr(target, name, then_interrupted)


@pytest.mark.parametrize("step", ["mkdtemp", "lock", "chmod", "make_staging_directory"])
def test_an_interrupt_right_after_each_step_of_making_the_staging_directory(tmp_path, monkeypatch, step):
    target = {"mkdtemp": tempfile, "lock": publish, "chmod": os, "make_staging_directory": publish}[step]
    _interrupt_after(target, {"lock": "_lock"}.get(step, step), monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        with publish.atomic_directory(tmp_path / "new" / "dst") as staging:
            (staging / "file").write_text("x")
    assert os.listdir(tmp_path) == []


def test_a_second_interrupt_during_the_cleanup_does_not_cut_it_short(tmp_path, monkeypatch):
    import shutil

    real = shutil.rmtree

    def interrupted_first(path, *args, **kwargs):  # a second Ctrl-C just as the removal starts
        signal.raise_signal(signal.SIGINT)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", interrupted_first)
    with pytest.raises(KeyboardInterrupt):
        with publish.atomic_directory(tmp_path / "dst") as staging:
            for n in range(20):
                (staging / f"file{n}").write_text("x")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def _staging_appeared(parent: Path) -> bool:
    return any(name.startswith(".dst.tmp-") for name in os.listdir(parent))


@pytest.mark.parametrize("how", ["once", "again and again until it exits"])
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sigint_the_moment_the_staging_directory_appears(sources, tmp_path, how, workers):
    runs = 4
    for run in range(runs):
        parent = tmp_path / f"run{run}"
        parent.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "mmparity", "convert", "--family", FAMILY, "--src",
                                 str(sources["hf"]), "--dst", str(parent / "dst"), "--to", "mcore", "--format",
                                 "legacy", "--workers", str(workers)],
                                env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=as_from_a_terminal)
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and not _staging_appeared(parent) and time.monotonic() < deadline:
                pass  # no sleep: the signal is meant to land as close to the mkdir as can be
            assert _staging_appeared(parent) or proc.poll() is not None, "no staging directory appeared"
            while proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                if how == "once":
                    break
                time.sleep(0.002)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if proc.returncode == 0:  # done before the signal landed: a complete conversion is a correct result
            assert os.listdir(parent) == ["dst"]
            continue
        assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err)
        assert err.splitlines() == ["mmparity: interrupted by SIGINT"], err
        assert os.listdir(parent) == [], (run, os.listdir(parent))


_GENERATED_TESTS = '''
from mmparity.cli.main import main


def test_a_conversion_stopped_by_sigterm():
    main(["convert", "--family", {family!r}, "--src", {src!r}, "--dst", {dst!r}, "--to", "mcore",
          "--format", "legacy", "--quiet"])


def test_the_next_one():
    open({marker!r}, "w").write("ran")
'''


def test_sigterm_to_a_test_runner_stops_the_suite_not_just_the_test(sources, tmp_path):
    """A CLI run in-process by a test (as pytest runs ours) cleans up on SIGTERM and then hands the
    signal on: the runner dies of it, rather than recording one failed test and going on."""
    work = tmp_path / "suite"
    work.mkdir()
    marker = tmp_path / "the-next-test-ran"
    (work / "test_generated.py").write_text(_GENERATED_TESTS.format(
        family=FAMILY, src=str(sources["hf"]), dst=str(work / "dst"), marker=str(marker)))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_generated.py"],
                            cwd=work, env={**os.environ, "PYTHONPATH": str(REPO), "MMPARITY_FAULT": "pause@3"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=as_from_a_terminal)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and not _staging_appeared(work) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _staging_appeared(work), "the conversion never paused inside its staging directory"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)  # a suite that went on would pause no more: it ends either way
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, out)
    assert not marker.exists(), out
    assert " passed" not in out and " failed" not in out, out  # no summary: the runner died
    assert sorted(os.listdir(work)) == ["test_generated.py"], os.listdir(work)  # the staging directory went
