"""The ``tpuray`` console script: hands ``sys.argv`` to the Rust CLI."""

from __future__ import annotations

import json
import os
import signal
import sys

from tpuray import _tpuray


def main() -> None:
    """Runs the tpuray CLI with this process's arguments and exits with its code.

    The processes that ``tpuray start`` spawns (head, node agent, and the
    agent's worker processes) run this CLI again; as the executable here is
    the Python interpreter, ``TPURAY_SELF_COMMAND`` tells the Rust side how:
    ``[sys.executable, "-m", "tpuray"]``, unless the caller already set it.
    """
    # Behave like the native binary, whose process has Rust's signal setup
    # rather than Python's: die quietly on a closed pipe (`tpuray list tasks |
    # head`; Python ignores SIGPIPE, which makes Rust's println! panic), and
    # stop at once on Ctrl-C (Python's handler only sets a flag, which nothing
    # reads while the Rust code runs). Verbs that handle SIGINT themselves
    # (`start --block`, `_head`, `_agent`) install their own handlers.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.setdefault(
        "TPURAY_SELF_COMMAND", json.dumps([sys.executable, "-m", "tpuray"])
    )
    argv = sys.argv[1:]
    if len(argv) >= 3 and argv[:2] == ["serve", "help"] and argv[2] in ("run", "deploy", "build"):
        argv = ["serve", argv[2], "--help"]  # clap's `help VERB`, for the Python verbs
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in ("run", "deploy", "build"):
        # Ray Serve's run/deploy/build are Python (they import the user's app); `serve
        # status` stays the Rust CLI's.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from tpuray.serve._cli import main as serve_main

        sys.exit(serve_main(argv[1:]))
    sys.exit(_tpuray.run(["tpuray", *argv]))
