"""Type stubs for ``tpuray._tpuray``, the Rust extension module."""

__version__: str
"""The version of the tpuray Rust crates this module was built from."""

def run(argv: list[str]) -> int:
    """Runs the tpuray command line.

    The GIL is released while the command runs; long-running verbs
    (``start --block`` and the internal ``_head``, ``_agent`` and
    ``_worker``) return only when their process is asked to stop.

    Args:
        argv: The command line, program name first, e.g.
            ``["tpuray", "status"]``.

    Returns:
        The exit code: 0 on success, 1 on an error (printed to stderr as
        ``tpuray: <message>``), 2 on a usage error.
    """
