"""The part of a compatibility script's stdout that is compared: what the script itself
printed. Dropped: the lines a cluster adds to a driver's stdout on its own (Ray's
``(raylet)``/``(autoscaler ...)`` diagnostics and the traceback, log-tail and blank lines
after them, and
worker output forwarded with a ``(name pid=N...)`` prefix, which names a process id),
and terminal colour codes.

Used by ``scripts/record-compat.sh`` (``python3 clean_output.py < raw > NAME.expected``)
and by ``test_compat.py``, so both sides are cleaned alike.
"""

from __future__ import annotations

import re
import sys

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_CLUSTER_LINE = re.compile(r"^\((raylet|autoscaler|gcs_server|dashboard)\b")
# "(f pid=1) ", "(pid=1, ip=10.0.0.2) ", "(Custom(x) pid=1) " (an actor's __repr__).
_WORKER_LINE = re.compile(r"^\((?:.* )?pid=\d+(?:, ip=[0-9A-Za-z.:\-]+)?\) ")
_FOLLOWS_DIAGNOSTIC = re.compile(r"^(ray::|  |[A-Za-z_.]+(Error|Exception|Warning):|Traceback)")


def clean(text: str) -> str:
    out = []
    in_diagnostic = False
    for line in _COLOUR.sub("", text).splitlines():
        if _CLUSTER_LINE.match(line):
            in_diagnostic = True
            continue
        # A diagnostic's own lines: indented log tails, tracebacks, and the blank lines
        # that end a multi-line raylet message.
        if in_diagnostic and (not line.strip() or _FOLLOWS_DIAGNOSTIC.match(line)):
            continue
        in_diagnostic = False
        if _WORKER_LINE.match(line):
            continue
        out.append(line)
    return "\n".join(out) + ("\n" if out else "")


_PID = re.compile(r"\bpid=\d+")


def driver_lines(text: str) -> str:
    """The worker lines of a driver's stdout (``(f pid=N) ...``), colours dropped and
    process ids written ``pid=N``: what ``logs_*`` recordings compare."""
    out = [_PID.sub("pid=N", l) for l in _COLOUR.sub("", text).splitlines() if _WORKER_LINE.match(l)]
    return "\n".join(out) + ("\n" if out else "")


if __name__ == "__main__":
    if sys.argv[1:] == ["--driver-lines"]:
        sys.stdout.write(driver_lines(sys.stdin.read()))
    else:
        sys.stdout.write(clean(sys.stdin.read()))
