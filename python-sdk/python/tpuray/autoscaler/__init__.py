"""Ray's ``ray.autoscaler`` package: :mod:`tpuray.autoscaler.sdk`."""

from tpuray.autoscaler import sdk

__all__ = ["sdk"]
