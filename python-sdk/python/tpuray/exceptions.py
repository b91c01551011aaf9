"""Exceptions raised by tpuray, with Ray's class names (``ray.exceptions``).

A task that raised re-raises at ``get`` as an instance of both :class:`RayTaskError`
and the user's own exception class (Ray's ``RayTaskError.as_instanceof_cause``), with
the remote traceback in its message.
"""

from __future__ import annotations


class RayError(Exception):
    """Base class of every tpuray error (Ray's ``RayError``)."""


class RaySystemError(RayError):
    """The cluster could not be reached or refused a call."""


class RayTaskError(RayError):
    """A task or actor method raised (Ray's ``RayTaskError``).

    Attributes:
        function_name: The remote function or method, e.g. ``f`` or ``Counter.incr``.
        traceback_str: The remote traceback, as formatted where it ran.
        cause: The original exception when it could be unpickled, else ``None``.
        pid: The worker process id; ``ip``: its node.
    """

    def __init__(self, function_name="", traceback_str="", cause=None, proctitle="", pid=0, ip=""):
        self.function_name = function_name
        self.traceback_str = traceback_str
        self.cause = cause
        self.proctitle = proctitle or f"ray::{function_name}()"
        self.pid = pid
        self.ip = ip
        super().__init__(self._message())

    def _message(self) -> str:
        head = f"{self.proctitle} (pid={self.pid}, ip={self.ip})"
        body = self.traceback_str.rstrip()
        return f"{head}\n{body}" if body else head

    def __str__(self) -> str:
        return self._message()

    def __reduce__(self):
        # Pickled with its fields (the default would call __init__ with the message
        # alone), so an error that a task re-raises from a nested get reaches its own
        # caller whole: as the cause's class too, at every depth (Ray's behaviour).
        fields = (self.function_name, self.traceback_str, self.cause, self.proctitle,
                  self.pid, self.ip)
        if type(self) is RayTaskError:
            return (RayTaskError, fields)
        return (_dual_from_fields, fields)

    def as_instanceof_cause(self):
        """This error as an instance of a class deriving from both ``RayTaskError`` and
        the cause's class, so ``except ZeroDivisionError`` catches it."""
        cause = self.cause
        if cause is None or isinstance(cause, RayTaskError):
            return self
        cause_cls = type(cause)
        try:
            name = f"RayTaskError({cause_cls.__name__})"
            cls = type(name, (RayTaskError, cause_cls), {"__init__": _dual_init, "__str__": RayTaskError.__str__})
            cls.__module__ = __name__
            err = cls.__new__(cls)
            err.__dict__.update(getattr(cause, "__dict__", {}))
            _dual_init(err, self, cause)
            return err
        except TypeError:
            return self


def _dual_from_fields(function_name, traceback_str, cause, proctitle, pid, ip):
    """Unpickles an error made by ``RayTaskError.as_instanceof_cause``: the same dual
    class again (``RayTaskError(ZeroDivisionError)``), or a plain ``RayTaskError`` when
    the cause's class cannot be derived from."""
    return RayTaskError(function_name, traceback_str, cause, proctitle, pid, ip).as_instanceof_cause()


def _dual_init(err, task_error=None, cause=None):
    if task_error is None:
        return
    err.function_name = task_error.function_name
    err.traceback_str = task_error.traceback_str
    err.cause = cause
    err.proctitle = task_error.proctitle
    err.pid = task_error.pid
    err.ip = task_error.ip
    # Ray's dual exception carries the cause as its only argument.
    err.args = (cause,) if cause is not None else ()


class WorkerCrashedError(RayError):
    """The worker running the task died and no retries were left."""


class RayActorError(RayError):
    """The actor died before or while running the call (Ray's ``RayActorError``)."""

    def __init__(self, message: str = "The actor died unexpectedly before finishing this task."):
        super().__init__(message)


class ActorDiedError(RayActorError):
    """The actor is dead (Ray 2.x subclass of ``RayActorError``)."""


class ActorUnavailableError(RayActorError):
    """The actor's process was lost while it ran the call, the call had no retries left,
    and the actor may restart: the call may or may not have run (Ray 2.60's
    ``ActorUnavailableError``; calls after it reach the restarted actor)."""


class ActorAlreadyExistsError(ValueError, RayError):
    """A named actor of that name already exists in the namespace (Ray 2.60's
    ``ActorAlreadyExistsError``, a ``ValueError`` too, as Ray keeps it)."""

    def __init__(self, error_message: str):
        super().__init__(error_message)
        self.error_message = error_message


class TaskCancelledError(RayError):
    """The task was cancelled with ``cancel``."""


class GetTimeoutError(RayError, TimeoutError):
    """``get`` ran out of time."""


class ObjectLostError(RayError):
    """Every copy of the object was lost."""


class OwnerDiedError(ObjectLostError):
    """The object's owner died."""


class ObjectFreedError(ObjectLostError):
    """The object was freed explicitly (Ray's ``ObjectFreedError``)."""


class ReferenceCountingAssertionError(ObjectLostError, AssertionError):
    """The object was already deleted by reference counting when it was asked for: its
    owner no longer has it (Ray's ``ReferenceCountingAssertionError``)."""


class ObjectReconstructionFailedError(ObjectLostError):
    """Every copy of the object was lost and it cannot be made again from lineage: the
    task that made it has no retries left (Ray's ``ObjectReconstructionFailedError``)."""


class ObjectFetchTimedOutError(ObjectLostError):
    """The object could not be fetched from any node that holds it (Ray's
    ``ObjectFetchTimedOutError``)."""


class NodeDiedError(RayError):
    """The node a task ran on is dead or unreachable, and the task had no retries left
    (Ray's ``NodeDiedError``): its worker's connection broke and the node's agent did
    not answer either. ``str(e)`` names the node's IP and id."""


class UserCodeException(RayError):
    """An exception raised by user code that a library ran, e.g. a ``tpuray.data`` UDF
    (Ray's ``UserCodeException``); the user's exception is its ``__cause__``."""


class ObjectStoreFullError(RayError):
    """The object store cannot take the object."""


class OutOfMemoryError(RayError):
    """A worker was killed for using too much memory."""


class RuntimeEnvSetupError(RayError):
    """A task's, actor's or job's runtime environment could not be set up (Ray's
    ``RuntimeEnvSetupError``): raised at the task's ``get`` and at the actor's calls.

    Args:
        error_message: why, with the installer's output (pip's or uv's) when an install
            failed, or the ``setup_timeout_seconds`` that ran out.
    """

    def __init__(self, error_message: str | None = None):
        super().__init__(error_message)
        self.error_message = error_message

    def __str__(self):
        msgs = ["Failed to set up runtime environment."]
        if self.error_message:
            msgs.append(self.error_message)
        return "\n".join(msgs)


class PendingCallsLimitExceeded(RayError):
    """Too many calls are queued for an actor."""


class TaskPlacementGroupRemoved(RayError):
    """The placement group the task was to run in was removed."""


class ActorPlacementGroupRemoved(RayError):
    """The placement group the actor was to run in was removed."""


class RaySchedulingError(RayError):
    """No node can run the request."""


class AuthenticationError(RayError):
    """A server refused this client's token: none sent (401) or a wrong one (403)
    (Ray's ``AuthenticationError``, raised by the job submission client)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class AsyncioActorExit(RayError):
    """Raised by ``exit_actor()`` inside an async actor's coroutine (Ray's
    ``AsyncioActorExit``); the actor then exits."""


__all__ = [
    "ActorAlreadyExistsError",
    "AuthenticationError",
    "RayError",
    "RaySystemError",
    "RayTaskError",
    "WorkerCrashedError",
    "RayActorError",
    "ActorDiedError",
    "ActorUnavailableError",
    "TaskCancelledError",
    "GetTimeoutError",
    "ObjectLostError",
    "OwnerDiedError",
    "ObjectFreedError",
    "ReferenceCountingAssertionError",
    "ObjectReconstructionFailedError",
    "ObjectFetchTimedOutError",
    "NodeDiedError",
    "ObjectStoreFullError",
    "OutOfMemoryError",
    "RuntimeEnvSetupError",
    "PendingCallsLimitExceeded",
    "TaskPlacementGroupRemoved",
    "ActorPlacementGroupRemoved",
    "RaySchedulingError",
    "AsyncioActorExit",
]
