import os

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker 'gpu'); none is present here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _single_process_parallel_state():
    """Every test starts from TP=1 mcore state so a test that changed it cannot leak."""
    yield
    from mmparity import runtime

    layout = runtime.current_layout()
    if layout is not None and (layout.tp, layout.pp) != (1, 1):
        runtime.teardown_parallel()
