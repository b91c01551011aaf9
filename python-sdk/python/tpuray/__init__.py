"""tpuray: Ray-style tasks and actors with TPU slices as first-class resources.

What this package holds today is the command line: the ``tpuray`` console
script (also ``python -m tpuray``) runs the same Rust CLI as the native
binary, through the ``tpuray._tpuray`` extension module, so ``tpuray start``,
``status``, ``list`` and ``stop`` work after a plain ``pip install``.

The Ray-Core-compatible Python API (``init``, ``remote``, ``get``, ...) is
not here yet; it arrives with the Python SDK, as a binding over the Rust core
worker.
"""

from tpuray._tpuray import __version__

__all__ = ["__version__"]
