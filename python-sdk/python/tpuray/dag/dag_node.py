"""Ray's lazy DAG API (``ray.dag``): ``f.bind(...)``, ``Actor.bind(...)``,
``actor.method.bind(...)``, ``InputNode``, ``MultiOutputNode`` and ``dag.execute(...)``.

``bind`` records a call instead of making it. A node's arguments may be values, other
nodes, or nodes inside lists, tuples and dicts. ``execute(*args, **kwargs)`` walks the
graph from the leaves up, in the order the arguments were bound, submitting each node
once per execution (a node two others use runs once): a function node is submitted as a
task and stands for its ``ObjectRef`` (so downstream tasks receive its value, resolved
by the core, without a round trip through the driver), a class node creates an actor
(a new one per execution, as Ray), a method node calls it (after the method bound
before it on the same class node: calls keep their bind order), the ``InputNode`` is
the value given to ``execute`` (one argument: itself; several, or keywords: a
:class:`DAGInputData` that ``input[i]`` and ``input.key`` index), and a
``MultiOutputNode`` is the list of its nodes' results. ``execute`` returns what the
root stands for: an ``ObjectRef`` (a list of them for ``num_returns > 1`` or a
``MultiOutputNode``) or an ``ActorHandle``.

Refused by name: compiled graphs (``experimental_compile``) and tensor transports
(``with_tensor_transport``).
"""

from __future__ import annotations

import uuid

_IN_CONTEXT = "__tpuray_in_context_manager__"


def _map_nodes(value, fn):
    """``value`` with every DAGNode in it (top level, or inside lists, tuples and
    dicts) replaced by ``fn(node)``."""
    if isinstance(value, DAGNode):
        return fn(value)
    if isinstance(value, list):
        return [_map_nodes(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_nodes(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_nodes(v, fn) for k, v in value.items()}
    return value


def _find_nodes(value, out: list) -> list:
    def record(n):
        out.append(n)
        return n

    _map_nodes(value, record)
    return out


class _Execution:
    """One ``execute`` call: its input and each node's result, by node."""

    def __init__(self, args, kwargs):
        self.args = args
        self.kwargs = kwargs
        self.results: dict = {}
        self.input_node = None


class DAGNode:
    """A recorded call: ``args``/``kwargs`` as bound, ``options`` for ``.options()``,
    ``other`` the nodes and values a subclass resolves besides its arguments."""

    def __init__(self, args, kwargs, options, other=None):
        self._bound_args = tuple(args or ())
        self._bound_kwargs = dict(kwargs or {})
        self._bound_options = dict(options or {})
        self._bound_other_args_to_resolve = dict(other or {})
        self._stable_uuid = uuid.uuid4().hex

    def get_args(self) -> tuple:
        return self._bound_args

    def get_kwargs(self) -> dict:
        return dict(self._bound_kwargs)

    def get_options(self) -> dict:
        return dict(self._bound_options)

    def get_other_args_to_resolve(self) -> dict:
        return dict(self._bound_other_args_to_resolve)

    def get_stable_uuid(self) -> str:
        return self._stable_uuid

    def _get_all_child_nodes(self) -> list:
        found: list = []
        _find_nodes([self._bound_args, self._bound_kwargs, self._bound_other_args_to_resolve], found)
        unique: list = []
        for n in found:
            if not any(n is u for u in unique):
                unique.append(n)
        return unique

    def execute(self, *args, **kwargs):
        """Runs the graph ending at this node with ``args``/``kwargs`` as the
        ``InputNode``'s value; returns what this node stands for (see the module)."""
        return self._run(_Execution(args, kwargs))

    def _run(self, ex: _Execution):
        if self._stable_uuid in ex.results:
            return ex.results[self._stable_uuid]
        resolve = lambda n: n._run(ex)  # noqa: E731
        args = _map_nodes(self._bound_args, resolve)
        kwargs = _map_nodes(self._bound_kwargs, resolve)
        other = _map_nodes(self._bound_other_args_to_resolve, resolve)
        result = self._execute_impl(ex, args, kwargs, other)
        ex.results[self._stable_uuid] = result
        return result

    def _execute_impl(self, ex, args, kwargs, other):
        raise NotImplementedError

    def experimental_compile(self, *args, **kwargs):
        raise NotImplementedError(
            "compiled graphs (experimental_compile) are not supported by tpuray: run the "
            "graph with .execute()"
        )

    def with_tensor_transport(self, *args, **kwargs):
        raise NotImplementedError(
            "tensor transports (with_tensor_transport) belong to compiled graphs, which "
            "tpuray does not support: values travel through the object store"
        )

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, d):
        self.__dict__.update(d)

    def __getattr__(self, attr: str):
        if attr == "bind":
            raise AttributeError(f".bind() cannot be used again on {type(self)} ")
        if attr == "remote":
            raise AttributeError(
                f".remote() cannot be used on {type(self)}. To execute the task graph for "
                "this node, use .execute()."
            )
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{attr}'")


class FunctionNode(DAGNode):
    """``f.bind(...)``: runs as the task ``f.options(**options).remote(...)``."""

    def __init__(self, remote_function, args, kwargs, options, other=None):
        self._body = remote_function
        super().__init__(args, kwargs, options, other)

    def _execute_impl(self, ex, args, kwargs, other):
        f = self._body.options(**self._bound_options) if self._bound_options else self._body
        return f.remote(*args, **kwargs)

    def __str__(self) -> str:
        return f"FunctionNode({getattr(self._body, '__name__', self._body)})"


class ClassNode(DAGNode):
    """``Actor.bind(...)``: creates the actor (once per execution); its methods'
    ``.bind`` make :class:`ClassMethodNode` s.

    Raises:
        ValueError: the constructor's arguments use the ``InputNode``.
    """

    def __init__(self, actor_class, args, kwargs, options, other=None):
        self._body = actor_class
        self._last_call = None
        super().__init__(args, kwargs, options, other)
        if any(isinstance(n, InputNode) for n in self._all_nodes_below()):
            raise ValueError(
                "InputNode handles user dynamic input the DAG, and cannot be used as args, "
                "kwargs, or other_args_to_resolve in ClassNode constructor because it is "
                "not available at class construction or binding time."
            )

    def _all_nodes_below(self) -> list:
        seen: list[DAGNode] = []
        stack = list(self._get_all_child_nodes())
        while stack:
            n = stack.pop()
            if not any(n is s for s in seen):
                seen.append(n)
                stack.extend(n._get_all_child_nodes())
        return seen

    def _execute_impl(self, ex, args, kwargs, other):
        cls = self._body.options(**self._bound_options) if self._bound_options else self._body
        return cls.remote(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            # Private and special names are never methods (and may be looked up before
            # __dict__ is filled, while unpickling).
            raise AttributeError(name)
        if name == "bind":
            raise AttributeError(f".bind() cannot be used again on {type(self)} ")
        if name == "remote":
            return DAGNode.__getattr__(self, name)
        getattr(self._body._cls, name)  # AttributeError for a method the class lacks
        return _UnboundClassMethodNode(self, name, {})

    def __str__(self) -> str:
        return f"ClassNode({self._body.__name__})"


class _UnboundClassMethodNode:
    """``class_node.method``: ``.bind(...)`` it (``.options(...)`` first, if needed)."""

    def __init__(self, actor, method_name: str, options: dict):
        self._actor = actor
        self._method_name = method_name
        self._options = options

    def options(self, **options):
        self._options = options
        return self

    def bind(self, *args, **kwargs):
        prev = self._actor._last_call if isinstance(self._actor, ClassNode) else None
        node = ClassMethodNode(self._method_name, args, kwargs, self._options,
                               {"parent": self._actor, "previous_call": prev})
        if isinstance(self._actor, ClassNode):
            self._actor._last_call = node
        return node

    def remote(self, *args, **kwargs):
        raise AttributeError(
            ".remote() cannot be used on ClassMethodNodes. Use .bind() instead to express "
            "an symbolic actor call."
        )


class ClassMethodNode(DAGNode):
    """``actor.method.bind(...)`` (on a class node or a live actor handle): the call
    ``method.options(**options).remote(...)`` on that actor."""

    def __init__(self, method_name, args, kwargs, options, other):
        self._method_name = method_name
        super().__init__(args, kwargs, options, other)

    def get_method_name(self) -> str:
        return self._method_name

    def _execute_impl(self, ex, args, kwargs, other):
        method = getattr(other["parent"], self._method_name)
        if self._bound_options:
            method = method.options(**self._bound_options)
        return method.remote(*args, **kwargs)

    def __str__(self) -> str:
        return f"ClassMethodNode({self._method_name}())"

    __repr__ = __str__


class DAGInputData:
    """The ``InputNode``'s value when ``execute`` got several arguments or keywords:
    ``data[i]`` is positional argument ``i``, ``data["k"]`` (or ``input.k``) keyword
    ``k``."""

    def __init__(self, *args, **kwargs):
        self._args = list(args)
        self._kwargs = kwargs

    def __getitem__(self, key):
        if isinstance(key, int):
            return self._args[key]
        if isinstance(key, str):
            return self._kwargs[key]
        raise ValueError("Please only use int index or str as first-level key to access fields of dag input.")


class InputNode(DAGNode):
    """The graph's input: what ``execute`` is given. Build the graph inside ``with
    InputNode() as inp:``; ``inp[0]``, ``inp["k"]`` and ``inp.k`` take parts of it.

    Raises:
        ValueError: arguments given (inputs come through ``execute``).
    """

    def __init__(self, *args, input_type=None, _other_args_to_resolve=None, **kwargs):
        if args or kwargs:
            raise ValueError("InputNode should not take any args or kwargs.")
        self.input_attribute_nodes: dict = {}
        self.input_type = input_type
        super().__init__((), {}, {}, _other_args_to_resolve)

    def _run(self, ex: _Execution):
        if ex.input_node is None:
            ex.input_node = self
        elif ex.input_node is not self:
            raise AssertionError("Each DAG should only have one unique InputNode.")
        return super()._run(ex)

    def _execute_impl(self, ex, args, kwargs, other):
        assert self._bound_other_args_to_resolve.get(_IN_CONTEXT), (
            "InputNode is a singleton instance that should be only used in context manager "
            "for dag building and execution. See the docstring of class InputNode for "
            "examples."
        )
        if len(ex.args) == 1 and not ex.kwargs:
            return ex.args[0]
        return DAGInputData(*ex.args, **ex.kwargs)

    def __enter__(self):
        self._bound_other_args_to_resolve[_IN_CONTEXT] = True
        return self

    def __exit__(self, *exc):
        pass

    def __getattr__(self, key: str):
        if key.startswith("__") and key.endswith("__") or key == "input_attribute_nodes":
            raise AttributeError(key)
        if key in ("bind", "remote"):
            return DAGNode.__getattr__(self, key)
        if key not in self.input_attribute_nodes:
            self.input_attribute_nodes[key] = InputAttributeNode(self, key, "__getattr__")
        return self.input_attribute_nodes[key]

    def __getitem__(self, key):
        assert isinstance(key, (str, int)), (
            "Please only use int index or str as first-level key to access fields of dag input."
        )
        if key not in self.input_attribute_nodes:
            self.input_attribute_nodes[key] = InputAttributeNode(self, key, "__getitem__")
        return self.input_attribute_nodes[key]

    def __str__(self) -> str:
        return "InputNode"


class InputAttributeNode(DAGNode):
    """``inp[key]`` or ``inp.key``: a part of the graph's input."""

    def __init__(self, dag_input_node, key, accessor_method: str, input_type=None):
        self._key = key
        self._accessor_method = accessor_method
        super().__init__((), {}, {}, {"dag_input_node": dag_input_node})

    @property
    def key(self):
        return self._key

    def _execute_impl(self, ex, args, kwargs, other):
        value = other["dag_input_node"]
        if isinstance(value, DAGInputData) or isinstance(self._key, int):
            return value[self._key]
        if self._accessor_method == "__getattr__":
            return getattr(value, self._key)
        return value[self._key]

    def __str__(self) -> str:
        return f'InputAttributeNode["{self._key}"]'


class MultiOutputNode(DAGNode):
    """Several results at once: ``execute`` returns the list of its nodes' results.

    Raises:
        ValueError: ``args`` is not a list or tuple.
    """

    def __init__(self, args, other_args_to_resolve=None):
        if isinstance(args, tuple):
            args = list(args)
        if not isinstance(args, list):
            raise ValueError(f"Invalid input type for `args`, {type(args)}.")
        super().__init__(args, {}, {}, other_args_to_resolve)

    def _execute_impl(self, ex, args, kwargs, other):
        return list(args)

    def __str__(self) -> str:
        return "MultiOutputNode"
