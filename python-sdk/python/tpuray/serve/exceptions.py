"""Serve's exceptions (Ray's ``ray.serve.exceptions`` names)."""

from __future__ import annotations

from tpuray.exceptions import ActorDiedError, RayError


class RayServeException(RayError):
    """A serve API call failed (bad input, no serve instance, a failed deployment)."""


class BackPressureError(RayServeException):
    """A deployment's handle queue is full (``max_queued_requests``): the request was
    rejected without being sent. The HTTP proxy answers 503."""


class DeploymentUnavailableError(RayServeException):
    """The deployment a request was sent to does not exist (any more)."""


class ReplicaDiedError(RayServeException, ActorDiedError):
    """Every replica a request was tried on died while running it (it was retried on
    another replica up to the handle's retry limit first). Also an ``ActorDiedError``."""


class DeployFailedError(RayServeException, RuntimeError):
    """``serve.run``: the application failed to deploy (Ray raises a ``RuntimeError``;
    this is one, and a ``RayServeException``)."""
