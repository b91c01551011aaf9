"""Exceptions of ``tpuray.data`` (Ray Data's ``ray.data.exceptions``)."""

from tpuray.exceptions import UserCodeException


class RayDataUserCodeException(UserCodeException):
    """An exception from a user's function in a ``tpuray.data`` transformation."""


class SystemException(Exception):
    """An exception from ``tpuray.data``'s own code."""


__all__ = ["RayDataUserCodeException", "SystemException", "UserCodeException"]
