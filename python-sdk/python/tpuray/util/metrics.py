"""``tpuray.util.metrics``: Ray's ``ray.util.metrics`` (``Counter``, ``Gauge``,
``Histogram``), with Ray's arguments, tag rules and errors.

A metric recorded in a worker or driver is exported by that process's node agent at
``/metrics`` on its ``--metrics-export-port``, named as Ray names user metrics:
``ray_<name>`` (counters ``ray_<name>_total``), with the metric's tags and Ray's
``SessionName``. Records stay in the process's memory and reach the agent within about
half a second (the process's totals, so a repeated report never counts twice); a
counter of a process that exited keeps its total. A driver on a host without a node of
its own reports to the node agent it leases from (the head node's) and says so once in
its log. Metrics recorded before ``tpuray.init()`` are sent once it has run.

Example:
    >>> from tpuray.util.metrics import Counter
    >>> c = Counter("requests", description="served", tag_keys=("route",))
    >>> c.inc(1.0, tags={"route": "/"})  # exported as ray_requests_total{route="/"}
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

logger = logging.getLogger(__name__)

# Prometheus's metric name rule (as Ray's copy of prometheus_client's).
_VALID_METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")

_told_destination = False


def _is_invalid_metric_name(name: str) -> bool:
    if len(name) == 0:
        raise ValueError("Empty name is not allowed. Please provide a metric name.")
    if not _VALID_METRIC_NAME_RE.match(name):
        warnings.warn(
            f"Invalid metric name: {name}. Metric will be discarded "
            "and data will not be collected or published. "
            "Metric names can only contain letters, numbers, _, and :. "
            "Metric names cannot start with numbers.",
            UserWarning,
        )
        return True
    return False


def _tell_destination() -> None:
    """Logs once where a driver on a host without a node sends its metrics."""
    global _told_destination
    if _told_destination:
        return
    from tpuray import _tpuray

    dest = _tpuray.metric_destination()
    if dest is None:
        return
    _told_destination = True
    address, elsewhere = dest
    if elsewhere:
        logger.warning(
            "tpuray.util.metrics: this host runs no tpuray node; the metrics this driver "
            "records are exported by the node agent at %s (the head node's), at /metrics "
            "on its MetricsExportPort (see tpuray.nodes())",
            address,
        )


class Metric:
    """The parent class of custom metrics (Ray's ``ray.util.metrics.Metric``).

    Args:
        name: The metric's name (letters, digits, ``_`` and ``:``; not starting with a
            digit). An invalid name warns and the metric records nothing, as Ray's.
        description: Its help text.
        tag_keys: The names of its tags, a tuple of str.

    Raises:
        ValueError: ``name`` is empty, or already defined in this process with another
            kind, other tag keys or other boundaries.
        TypeError: ``tag_keys`` is not a tuple of str.
    """

    _kind = ""

    def __init__(
        self,
        name: str,
        description: str = "",
        tag_keys: Optional[Tuple[str, ...]] = None,
    ):
        self._discard_metric = _is_invalid_metric_name(name)
        self._name = name
        self._description = description
        self._default_tags: Dict[str, str] = {}
        self._tag_keys = tag_keys or tuple()
        if not isinstance(self._tag_keys, tuple):
            raise TypeError(
                "tag_keys should be a tuple type, got: " f"{type(self._tag_keys)}"
            )
        for key in self._tag_keys:
            if not isinstance(key, str):
                raise TypeError(f"Tag keys must be str, got {type(key)}.")
        if ":" in self._name:
            warnings.warn(
                f"Metric name {self._name} contains a : character, which is no longer allowed. "
                f"Please migrate to the new metric name format. "
                f"This will be an error in the future.",
                FutureWarning,
            )

    def _define(self, boundaries: List[float]) -> None:
        if self._discard_metric:
            return
        from tpuray import _tpuray

        _tpuray.metric_define(
            self._kind, self._name, self._description, list(self._tag_keys), boundaries
        )

    def set_default_tags(self, default_tags: Dict[str, str]) -> "Metric":
        """Sets tags used by every record (tags given to a record win).

        Args:
            default_tags: Values for some of ``tag_keys``.

        Returns:
            The metric itself.

        Raises:
            ValueError: A key is not one of ``tag_keys``.
            TypeError: A value is not a str.
        """
        for key, val in default_tags.items():
            if key not in self._tag_keys:
                raise ValueError(f"Unrecognized tag key {key}.")
            if not isinstance(val, str):
                raise TypeError(f"Tag values must be str, got {type(val)}.")
        self._default_tags = default_tags
        return self

    def _get_final_tags(self, tags: Optional[Dict[str, str]]) -> Dict[str, str]:
        if not tags:
            return self._default_tags
        for val in tags.values():
            if not isinstance(val, str):
                raise TypeError(f"Tag values must be str, got {type(val)}.")
        return {**self._default_tags, **tags}

    def _validate_tags(self, final_tags: Dict[str, str]) -> None:
        missing = [k for k in self._tag_keys if k not in final_tags]
        if missing:
            raise ValueError(f"Missing value for tag key(s): {','.join(missing)}.")

    def _record(
        self, value: Union[int, float], tags: Optional[Dict[str, str]] = None
    ) -> None:
        if self._discard_metric:
            return
        final = self._get_final_tags(tags)
        self._validate_tags(final)
        from tpuray import _tpuray

        _tpuray.metric_record(
            self._name, [final[k] for k in self._tag_keys], float(value)
        )
        _tell_destination()

    @property
    def info(self) -> Dict[str, Any]:
        """The metric's name, description, tag keys and default tags."""
        return {
            "name": self._name,
            "description": self._description,
            "tag_keys": self._tag_keys,
            "default_tags": self._default_tags,
        }


class Counter(Metric):
    """A cumulative metric that only goes up (a Prometheus counter, exported as
    ``ray_<name>_total``).

    Args:
        name: The metric's name.
        description: Its help text.
        tag_keys: The names of its tags.
    """

    _kind = "counter"

    def __init__(
        self,
        name: str,
        description: str = "",
        tag_keys: Optional[Tuple[str, ...]] = None,
    ):
        super().__init__(name, description, tag_keys)
        self._define([])

    def __reduce__(self):
        return self.__class__, (self._name, self._description, self._tag_keys)

    def inc(self, value: Union[int, float] = 1.0, tags: Optional[Dict[str, str]] = None):
        """Adds ``value`` (default 1) to the series of ``tags``.

        Raises:
            TypeError: ``value`` is not a number, or a tag value not a str.
            ValueError: ``value`` is not > 0, or a tag key has no value.
        """
        if not isinstance(value, (int, float)):
            raise TypeError(f"value must be int or float, got {type(value)}.")
        if value <= 0:
            raise ValueError(f"value must be >0, got {value}")
        self._record(value, tags=tags)


class Histogram(Metric):
    """Counts observations in buckets (a Prometheus histogram, ``ray_<name>_bucket``,
    ``_sum``, ``_count``).

    Args:
        name: The metric's name.
        description: Its help text.
        boundaries: Bucket upper bounds, positive numbers.
        tag_keys: The names of its tags.

    Raises:
        ValueError: ``boundaries`` is missing or empty, or holds a value that is not
            positive.
    """

    _kind = "histogram"

    def __init__(
        self,
        name: str,
        description: str = "",
        boundaries: Optional[List[float]] = None,
        tag_keys: Optional[Tuple[str, ...]] = None,
    ):
        super().__init__(name, description, tag_keys)
        if boundaries is None or len(boundaries) == 0:
            raise ValueError(
                "boundaries argument should be provided when using "
                "the Histogram class. e.g., "
                'Histogram("name", boundaries=[1.0, 2.0])'
            )
        for i, boundary in enumerate(boundaries):
            if boundary <= 0:
                raise ValueError(
                    "Invalid `boundaries` argument at index "
                    f"{i}, {boundaries}. Use positive values for the arguments."
                )
        self.boundaries = boundaries
        # Prometheus's buckets ascend; repeated bounds are one bucket.
        self._define(sorted({float(b) for b in boundaries}))

    def observe(self, value: Union[int, float], tags: Optional[Dict[str, str]] = None):
        """Adds ``value`` to the bucket it falls in.

        Raises:
            TypeError: ``value`` is not a number.
        """
        if not isinstance(value, (int, float)):
            raise TypeError(f"value must be int or float, got {type(value)}.")
        self._record(value, tags)

    def __reduce__(self):
        return Histogram, (self._name, self._description, self.boundaries, self._tag_keys)

    @property
    def info(self):
        """As :attr:`Metric.info`, with the boundaries."""
        info = super().info
        info.update({"boundaries": self.boundaries})
        return info


class Gauge(Metric):
    """The last value set (a Prometheus gauge, ``ray_<name>``); across the processes of
    a node, the value set last.

    Args:
        name: The metric's name.
        description: Its help text.
        tag_keys: The names of its tags.
    """

    _kind = "gauge"

    def __init__(
        self,
        name: str,
        description: str = "",
        tag_keys: Optional[Tuple[str, ...]] = None,
    ):
        super().__init__(name, description, tag_keys)
        self._define([])

    def set(self, value: Optional[Union[int, float]], tags: Optional[Dict[str, str]] = None):
        """Sets the series of ``tags`` to ``value`` (``None``: does nothing).

        Raises:
            TypeError: ``value`` is not a number.
        """
        if value is None:
            return
        if not isinstance(value, (int, float)):
            raise TypeError(f"value must be int or float, got {type(value)}.")
        self._record(value, tags)

    def __reduce__(self):
        return Gauge, (self._name, self._description, self._tag_keys)


__all__ = [
    "Counter",
    "Histogram",
    "Gauge",
]
