"""``@tpuray.remote`` functions (Ray's ``RemoteFunction``)."""

from __future__ import annotations

import functools
import inspect

from tpuray import _tpuray
from tpuray._private import options as _options
from tpuray._private import worker
from tpuray._private.serialization import ObjectRef, ObjectRefGenerator


class RemoteFunction:
    """A function that runs as a task: ``f.remote(*args)`` returns an ``ObjectRef``
    (or a list of ``num_returns`` refs); ``f.options(...)`` overrides options per call."""

    def __init__(self, function, options: dict):
        _options.check(options, actor=False)
        # Ray 2.60 (remote_function.py): a generator function streams by default.
        self._is_generator = inspect.isgeneratorfunction(function)
        _options.check_num_returns(options.get("num_returns"), self._is_generator)
        self._function = function
        self._options = dict(options)
        self._key = None
        self._core_options = None
        self._name = getattr(function, "__qualname__", getattr(function, "__name__", "f"))
        functools.update_wrapper(self, function)

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"Remote functions cannot be called directly. Instead of running '{self._name}()', "
            f"try '{self._name}.remote()'."
        )

    def options(self, **options) -> "RemoteFunction":
        _options.check(options, actor=False, in_options=True)
        _options.check_num_returns(options.get("num_returns"), self._is_generator)
        merged = {**self._options, **options}
        f = RemoteFunction.__new__(RemoteFunction)
        f.__dict__.update(self.__dict__)
        f._options = merged
        f._core_options = None
        return f

    def remote(self, *args, **kwargs):
        worker.auto_init()
        if self._key is None:
            self._key = worker.export(self._function)
        opts = self._core_options
        if opts is None:
            # Options are fixed per RemoteFunction (``options()`` makes a new one).
            opts = self._core_options = _options.task_core_options(
                self._options, self._name, self._is_generator
            )
        if opts["scheduling"] is None and worker.state.mode == "worker":
            opts = _options.captured(opts, self._options)
        streaming = self._options.get("num_returns") == "streaming" or (
            self._is_generator and self._options.get("num_returns") is None
        )
        if streaming:
            task_id = _tpuray.submit_streaming(self._key, worker.encode_args(args, kwargs), opts)
            return ObjectRefGenerator(task_id, self._name)
        refs = _tpuray.submit(
            self._key, worker.encode_args(args, kwargs, _options.retry_filter(self._options)), opts
        )
        refs = [ObjectRef(r) for r in refs]
        n = opts["num_returns"]
        if n == 1:
            return refs[0]
        return refs if n != 0 else None

    def bind(self, *args, **kwargs):
        """A lazy call of this function (Ray's DAG API): a ``tpuray.dag.FunctionNode``
        that runs when the graph is executed."""
        from tpuray.dag import FunctionNode

        return FunctionNode(self, args, kwargs, {})
