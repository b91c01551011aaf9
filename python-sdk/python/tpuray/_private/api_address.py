"""The HTTP API a client in this process talks to when given no address."""

from __future__ import annotations

from typing import Optional

from tpuray import _tpuray


def default_address(address: Optional[str]) -> Optional[str]:
    """``address``, or, when it is None and this process is a driver or worker of a
    cluster, that cluster's head (Ray's clients use the connected cluster first); None
    leaves the choice to the client's own rules (environment, this machine's cluster)."""
    if address is None and _tpuray.is_initialized():
        try:
            return _tpuray.process_info()["head_address"] or None
        except RuntimeError:
            return None
    return address
