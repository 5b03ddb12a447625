import argparse
import os

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tests read mmparity's own rank files back with torch.load(weights_only=True); those hold
# Megatron-LM's `args` Namespace. megatron-core allow-lists it when first imported, so without this
# whether a test could read a rank file depended on which test imported megatron-core first (and a
# `torch.serialization.safe_globals([...])` block removes what it names on exit: don't use one).
torch.serialization.add_safe_globals([argparse.Namespace])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker 'gpu'); none is present here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The quick loop (`-m "not slow"`) stays quick only if every test that spawns ranks says so: the
# marker is checked where ranks are spawned, not left to memory.
_running: list = []


def pytest_configure(config):
    from mmparity.parallel import runtime

    spawn = runtime.spawn

    def spawn_in_a_slow_test(fn, world_size, *args):
        item = _running[-1] if _running else None
        if item is not None and world_size > 1 and item.get_closest_marker("slow") is None:
            raise AssertionError(f"{item.nodeid} spawns {world_size} ranks but is not marked slow "
                                 "(pytest.mark.slow: spawned ranks are what the quick loop leaves out)")
        return spawn(fn, world_size, *args)

    runtime.spawn = spawn_in_a_slow_test
    # The suite launches ranks a few hundred times; each spawned rank would import megatron-core
    # and transformers afresh. The CLI's own rank launches (tests that run `mmparity` as a child
    # process) still spawn, as a user's do. Where CUDA is present the ranks keep spawning: forking
    # has not been tried on a GPU runner.
    if not torch.cuda.is_available():
        runtime.share_rank_imports(["torch.multiprocessing", "torch.distributed", "megatron.core", "transformers",
                                    "mmparity.parallel.runtime", "mmparity.models.registry", "mmparity.models.spec",
                                    "mmparity.parity.harness", "mmparity.convert"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.fixture(autouse=True)
def _single_process_parallel_state():
    """Every test starts from TP=1 mcore state so a test that changed it cannot leak."""
    yield
    from mmparity.parallel import runtime

    layout = runtime.current_layout()
    if layout is not None and (layout.tp, layout.pp) != (1, 1):
        runtime.teardown_parallel()


def pytest_terminal_summary(terminalreporter):
    """How many faults the fault suite (tests/test_faults*.py) tried and how many the tool handled."""
    stats = terminalreporter.stats
    outcome = {}
    for kind in ("passed", "failed", "error", "skipped"):
        for report in stats.get(kind, []):
            if getattr(report, "when", "call") in ("call", "setup") and _is_fault_test(report.nodeid):
                outcome[report.nodeid] = kind
    if outcome:
        counts = {kind: sum(1 for k in outcome.values() if k == kind) for kind in ("passed", "failed", "error", "skipped")}
        tried = len(outcome) - counts["skipped"]
        terminalreporter.write_line(f"fault injection: {tried} bad inputs / faults tried, {counts['passed']} handled, "
                                    f"{counts['failed'] + counts['error']} not handled, {counts['skipped']} skipped")


def _is_fault_test(nodeid: str) -> bool:
    """The fault suite is tests/faults/test_faults.py and its topical siblings tests/test_faults_*.py."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return name == "test_faults.py" or (name.startswith("test_faults_") and name.endswith(".py"))
