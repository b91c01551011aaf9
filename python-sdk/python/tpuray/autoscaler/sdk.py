"""Ray 2.60's ``ray.autoscaler.sdk.request_resources`` for tpuray's autoscaler
(``tpuray start --head --autoscaling-config FILE``).

The request is stored in the head's KV (namespace ``autoscaler``, key
``request_resources``, a JSON list of bundles), where the autoscaler reads it about once a
second; each call replaces the previous one, as in Ray.
"""

from __future__ import annotations

import json
from numbers import Real
from typing import Dict, List, Optional

__all__ = ["request_resources"]

#: The head KV namespace and key the autoscaler reads (cli/src/autoscaler/mod.rs).
KV_NAMESPACE = "autoscaler"
REQUEST_KEY = b"request_resources"


def request_resources(
    num_cpus: Optional[int] = None,
    bundles: Optional[List[dict]] = None,
    bundle_label_selectors: Optional[List[dict]] = None,
) -> None:
    """Asks the autoscaler to scale until the cluster's total resources hold the request
    (Ray's ``request_resources``): ``num_cpus`` one-CPU bundles plus ``bundles``, fitted
    against every node's total whatever runs there, within each node type's
    ``max_workers``. The request persists until the next call replaces it
    (``request_resources()`` with nothing clears it); nodes it needs are not removed as
    idle.

    Args:
        num_cpus: A number of CPUs (an ``int`` >= 0).
        bundles: A list of resource maps, e.g. ``[{"CPU": 1}] * 6`` or
            ``[{"GPU": 1, "CPU": 4}]``; amounts are numbers >= 0.
        bundle_label_selectors: Ray's per-bundle label selectors. tpuray's autoscaler
            does not match them; anything but ``None`` or a list of empty dicts is refused.

    Raises:
        TypeError: ``num_cpus`` not an int, ``bundles`` not a list of dicts of
            ``str`` to numbers (Ray's messages).
        ValueError: a negative ``num_cpus`` or amount.
        NotImplementedError: non-empty ``bundle_label_selectors``.
        RuntimeError: not connected to a cluster.
    """
    import tpuray
    from tpuray import _tpuray

    if num_cpus is not None and (not isinstance(num_cpus, int) or isinstance(num_cpus, bool)):
        raise TypeError("num_cpus should be of type int.")
    if num_cpus is not None and num_cpus < 0:
        raise ValueError(f"num_cpus should be >= 0, got {num_cpus}")
    if bundles is not None:
        if not isinstance(bundles, list):
            raise TypeError("bundles should be of type List")
        for bundle in bundles:
            if not isinstance(bundle, dict):
                raise TypeError("each bundle should be a Dict.")
            for key, value in bundle.items():
                if not isinstance(key, str):
                    raise TypeError("each bundle key should be str.")
                if not isinstance(value, Real) or isinstance(value, bool):
                    raise TypeError("each bundle value should be int or float.")
                if value < 0:
                    raise ValueError(f"bundle amount of {key!r} should be >= 0, got {value}")
    if bundle_label_selectors is not None:
        if bundles is None or len(bundles) != len(bundle_label_selectors):
            raise ValueError(
                "If bundle_label_selectors is provided, bundles must also be provided and have the same length."
            )
        if any(s for s in bundle_label_selectors):
            raise NotImplementedError(
                "request_resources(bundle_label_selectors=...) is not supported by tpuray's autoscaler "
                "(it fits bundles by resources only); pass None"
            )
    if not tpuray.is_initialized():
        raise RuntimeError("Ray is not initialized yet")
    request: List[Dict[str, float]] = [{"CPU": 1} for _ in range(num_cpus or 0)]
    request.extend({k: float(v) for k, v in b.items()} for b in (bundles or []))
    _tpuray.kv_put(KV_NAMESPACE, REQUEST_KEY, json.dumps(request).encode(), True)
