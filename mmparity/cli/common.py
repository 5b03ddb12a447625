"""What every subcommand shares: the usage-error type, exit codes, atomic small-file writes."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A user error: printed as one line, exit code 2, no traceback, nothing written (but the
    reports ``check`` was asked for, holding the error: see ``check.write_usage_error_reports``)."""


def one_line(message: str) -> str:
    # One line whatever the message is: an exception text that spans lines (a list of problems,
    # a tool's own multi-line error) still reaches a user, and a script reading stderr, as one.
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


def fail_usage(message: str) -> int:
    print(f"mmparity: error: {one_line(message)}", file=sys.stderr)
    return EXIT_USAGE


def check_output_path(option: str, path: str) -> None:
    """Refuses, before any work, a report path that cannot become a file: a directory, or one in
    a directory that does not exist."""
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory; name a file to write the report to")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{option} {path}: directory {directory} does not exist")


def write_text_atomic(path: str, text: str, option: str = "") -> None:
    """Write a whole file or nothing: a temporary sibling renamed into place. A failure (disk full,
    permissions) is a usage error naming the path; nothing is left behind."""
    where = f"{option} {path}" if option else str(path)
    check_output_path(option or "cannot write", path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".mmparity-", dir=os.path.dirname(os.path.abspath(path)))
        # mkstemp makes the file private (0600); a report is an artifact others read (a CI page,
        # a JUnit file a service picks up): the mode a plain open would give, by the umask.
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise UsageError(f"{where}: cannot write the report ({exc.strerror or exc})") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


# Past these an image is no parity input but a memory bomb: 2**26 pixels in float32 are 800 MB for
# the image alone, before a single patch embedding.
MAX_IMAGE_SIDE = 2**14
MAX_IMAGE_PIXELS = 2**26
# torch.manual_seed takes 64-bit seeds; keep to the range every seeded generator accepts.
MAX_SEED = 2**63 - 1


def check_seed(seed: int) -> int:
    if not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed {seed}: must be between 0 and {MAX_SEED}")
    return seed


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
    # Some of megatron's optional imports pull in absl, whose Python logger warns on first use.
    logging.getLogger("absl").setLevel(logging.ERROR)
    # Spawned ranks (parallel.runtime.spawn) take these filters and levels before they import
    # anything: each rank would otherwise repeat every line above once more.


def parse_iteration(text: str | None) -> int | str | None:
    """``--iteration``: an iteration number, ``release``, or None (the tracker's)."""
    if text is None or text == "release":
        return text
    from mmparity.io.layout import parse_iteration_number

    number = parse_iteration_number(text)
    if number is None:
        raise UsageError(f"--iteration takes an iteration number (ASCII digits, at most 18) or 'release', "
                         f"got {text[:40]!r}")
    return number


def parse_image_size(text: str) -> tuple[int, int]:
    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"image size {text!r} is not of the form HxW (e.g. 48x80)") from None
    if height <= 0 or width <= 0:
        raise UsageError(f"image size {text!r} must be positive")
    if max(height, width) > MAX_IMAGE_SIDE or height * width > MAX_IMAGE_PIXELS:
        raise UsageError(f"image size {text!r} is too large: at most {MAX_IMAGE_SIDE} pixels a side and "
                         f"{MAX_IMAGE_PIXELS} in all")
    return height, width


def select_device_and_backend(device: str, dtype: str, backend: str | None) -> None:
    """Refuse a device the running machine lacks and an attention backend that cannot run on it."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available on this machine")
    if backend is not None:
        from mmparity.models.core import attention

        try:
            attention.set_backend(backend, device=device, dtype=dtype)
        except ValueError as exc:
            raise UsageError(str(exc)) from None


def human_bytes(nbytes: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return str(nbytes)


def config_facts(directory):
    """A checkpoint's config facts, to name the family that takes it whole; None if unreadable
    (with its family given, nothing else needed them)."""
    from mmparity.io.fsio.errors import CheckpointError
    from mmparity.convert.configs import read_config_facts

    try:
        return read_config_facts(directory)
    except CheckpointError:
        return None


def left_out_line(family, use, facts, lead: str = "") -> str:
    """What a conversion did not take of its source (a ``SourceUse``), by part, and who would take
    the whole (from the config ``facts``, when known)."""
    from mmparity.models import registry as families

    fam = families.resolve(family)  # a name (convert's result) or the record (check's)
    family = fam.name

    def count(n: int) -> str:
        return f"{n} tensor{'' if n == 1 else 's'}"

    parts = ", ".join(f"{module} ({count(n)}, {human_bytes(b)})" for module, n, b in use.left_out)
    line = (f"{family}: {lead}left out {use.left_out_tensors} of {use.tensors} source tensors "
            f"({human_bytes(use.left_out_bytes)} of {human_bytes(use.nbytes)}): {parts}; converted the other "
            f"{use.converted} ({human_bytes(use.converted_bytes)})")
    if facts is not None and fam.takes(facts)[0] != 2:
        line += f"; {families.whole_clause(facts)}"
    return line


def shows_progress(quiet: bool) -> bool:
    """Progress is for a person watching: drawn on stderr when it is a terminal, never into a pipe
    or a file (a log, CI), nor with --quiet."""
    return not quiet and sys.stderr.isatty()


class ProgressLine:
    """One line on stderr, redrawn in place at each :mod:`mmparity.progress` step:
    ``check llava: case 2/4 images-3: reference``, and where ranks run, each rank's own step."""

    def __init__(self, stream):
        self.stream, self.lead, self.text, self.ranks, self.drawn = stream, "", "", {}, False

    def __call__(self, text: str, where: str = "") -> None:
        if where:
            self.ranks[where] = text
        else:  # this process moved on: what its ranks said is over
            self.text, self.ranks = text, {}
        self.draw()

    def start(self, lead: str, text: str = "") -> None:
        """A new piece of work (a family, a checkpoint): ``lead`` heads the line from now on."""
        self.lead = lead
        self(text)

    def draw(self) -> None:
        line = ": ".join(part for part in (self.lead, self.text) if part)
        if self.ranks:
            ranks = sorted(self.ranks.items(), key=lambda item: int(item[0].rpartition(" ")[2] or 0))
            line += " [" + "; ".join(f"{where}: {text}" for where, text in ranks) + "]"
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            width = 80
        if len(line) > width - 1:  # a line that wrapped could not be redrawn in place
            line = line[:max(width - 2, 1)] + "…"
        self.stream.write(f"\r{line}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def clear(self) -> None:
        """Before anything else is printed, and at the end: the line leaves no trace."""
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False


@contextlib.contextmanager
def progress_line(quiet: bool):
    """A :class:`ProgressLine` listening to :mod:`mmparity.progress` for the block when
    :func:`shows_progress`; otherwise one that is never drawn."""
    line = ProgressLine(sys.stderr)
    if not shows_progress(quiet):
        line.draw = lambda: None
        yield line
        return
    from mmparity import progress

    try:
        with progress.listen(line):
            yield line
    finally:
        line.clear()
