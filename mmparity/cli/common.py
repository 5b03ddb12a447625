"""What every subcommand shares: the usage-error type, exit codes, atomic small-file writes."""

from __future__ import annotations

import os
import sys
import tempfile

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A user error: printed as one line, exit code 2, no traceback, nothing written."""


def fail_usage(message: str) -> int:
    print(f"mmparity: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def write_text_atomic(path: str, text: str) -> None:
    """Write a whole file or nothing: a temporary sibling renamed into place."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"cannot write {path}: directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".mmparity-", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def quiet_third_party_warnings() -> None:
    """mcore and transformers warn at import about optional kernels; CLI users need none of it."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    # A CUDA build of torch on a machine without CUDA logs "No CUDA runtime is found" when
    # megatron imports torch.utils.cpp_extension; a user error must still be one line.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def parse_image_size(text: str) -> tuple[int, int]:
    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"image size {text!r} is not of the form HxW (e.g. 48x80)") from None
    if height <= 0 or width <= 0:
        raise UsageError(f"image size {text!r} must be positive")
    return height, width


def select_device_and_backend(device: str, dtype: str, backend: str | None) -> None:
    """Refuse a device this machine lacks and an attention backend that cannot run on it."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available on this machine")
    if backend is not None:
        from mmparity.native.core import attention

        try:
            attention.set_backend(backend, device=device, dtype=dtype)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
