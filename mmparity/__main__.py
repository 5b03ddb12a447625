import os

# torch's C++ side logs a warning (with a C++ stack) to stderr when a peer's connection drops, e.g.
# when a rank of a multi-process convert dies; the command's own one-line error says what happened.
# Read once, when torch loads: so here, before anything imports it. A user's own setting stands.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from mmparity.cli.main import main  # noqa: E402

raise SystemExit(main())
