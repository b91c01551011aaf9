"""``@serve.deployment``, ``Deployment`` and ``Application`` (a bound deployment graph).

As in Ray Serve (https://docs.ray.io/en/latest/serve/model_composition.html): a
``Deployment`` is a class or function with options; ``Deployment.bind(*args, **kwargs)``
gives an ``Application``; an ``Application`` passed (at the top level, or inside lists,
tuples and dict values) as an argument of another ``bind`` becomes, in the replicas of
that other deployment, a :class:`~tpuray.serve.handle.DeploymentHandle` to it.
"""

from __future__ import annotations

import inspect

from tpuray.serve import config as _config


class Deployment:
    """A class or function to serve, with its options. Build one with
    ``@serve.deployment``; ``.options(...)`` returns a copy with some options changed,
    ``.bind(...)`` the application that deploys it."""

    def __init__(self, target, name: str, options: dict):
        self._target = target
        self._name = name
        self._options = options

    @property
    def name(self) -> str:
        return self._name

    @property
    def func_or_class(self):
        return self._target

    @property
    def num_replicas(self):
        return self._options["num_replicas"]

    @property
    def max_ongoing_requests(self) -> int:
        return self._options["max_ongoing_requests"]

    @property
    def max_queued_requests(self) -> int:
        return self._options["max_queued_requests"]

    @property
    def ray_actor_options(self):
        return self._options["ray_actor_options"]

    @property
    def autoscaling_config(self):
        return self._options["autoscaling_config"]

    @property
    def user_config(self):
        return self._options["user_config"]

    def options(self, **kwargs) -> "Deployment":
        """A copy with the given options changed (same keywords as ``@serve.deployment``).

        Raises:
            TypeError/ValueError: an unknown option or a bad value.
        """
        name = kwargs.pop("name", None) or self._name
        return Deployment(self._target, name, _config.deployment_options(kwargs, self._options))

    def bind(self, *args, **kwargs) -> "Application":
        """The application that deploys this deployment, constructed with these
        arguments (other ``Application``s among them become handles)."""
        return Application(self, args, kwargs)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            "Deployments cannot be constructed directly. Use `.bind()` instead."
        )

    def __repr__(self) -> str:
        return f"Deployment(name={self._name})"


class Application:
    """A deployment bound to its constructor arguments (Ray's ``Application``); the
    root one is the ingress that ``serve.run`` returns a handle to and that HTTP
    requests reach."""

    def __init__(self, deployment: Deployment, args: tuple, kwargs: dict):
        self._deployment = deployment
        self._args = args
        self._kwargs = kwargs

    def __repr__(self) -> str:
        return f"Application({self._deployment.name})"

    def _build(self, app_name: str) -> tuple[str, list]:
        """Walks the graph from this ingress.

        Returns:
            (the ingress deployment's name, a list of ``{"name", "target", "args",
            "kwargs", "config"}``, one per deployment, dependencies first), where bound
            applications in the arguments are replaced by ``DeploymentHandle``s.
        """
        from tpuray.serve.handle import DeploymentHandle

        names: dict[int, str] = {}  # id(Application) -> deployment name
        used: dict[str, int] = {}
        out: list = []

        def visit(app: "Application") -> str:
            if id(app) in names:
                return names[id(app)]
            base = app._deployment.name
            name = base
            n = used.get(base, 0)
            if n:
                # As Ray: same-named deployments in one application get a suffix.
                name = f"{base}_{n}"
            used[base] = n + 1
            names[id(app)] = name

            def convert(v):
                if isinstance(v, Application):
                    return DeploymentHandle(visit(v), app_name)
                if isinstance(v, Deployment):
                    raise TypeError(
                        f"deployment {v.name!r} was passed to {base}.bind() without being "
                        f"bound: pass {v.name}.bind(...) instead"
                    )
                if isinstance(v, list):
                    return [convert(x) for x in v]
                if isinstance(v, tuple):
                    return tuple(convert(x) for x in v)
                if isinstance(v, dict):
                    return {k: convert(x) for k, x in v.items()}
                return v

            args = convert(app._args)
            kwargs = convert(app._kwargs)
            out.append(
                {
                    "name": name,
                    "target": app._deployment._target,
                    "args": args,
                    "kwargs": kwargs,
                    "config": app._deployment._options,
                }
            )
            return name

        ingress = visit(self)
        return ingress, out


def deployment(_func_or_class=None, **options):
    """Makes a class or function a :class:`Deployment` (Ray's ``@serve.deployment``).

    Options (Ray's names and defaults): ``name`` (default: the class or function name),
    ``num_replicas`` (int, or ``"auto"``), ``ray_actor_options`` (``num_cpus`` (default
    1 as in Ray), ``num_gpus``, ``memory``, ``resources`` e.g. ``{"TPU": 4}``,
    ``accelerator_type``, ``runtime_env``, ``label_selector``), ``max_ongoing_requests``
    (5), ``max_queued_requests`` (-1: unbounded), ``autoscaling_config`` (dict:
    ``min_replicas``, ``max_replicas``, ``initial_replicas``, ``target_ongoing_requests``,
    ``upscale_delay_s``, ``downscale_delay_s``, factors), ``user_config`` (passed to
    ``reconfigure``), ``health_check_period_s`` (10), ``health_check_timeout_s`` (30),
    ``graceful_shutdown_wait_loop_s``, ``graceful_shutdown_timeout_s`` (20), and
    tpuray's ``request_router`` (``"pow2"`` or ``"prefix_affinity"``) with
    ``request_router_kwargs`` (``prefix_chars``, ``imbalanced_threshold``).

    Source: https://docs.ray.io/en/latest/serve/api/doc/ray.serve.deployment.html

    Raises:
        TypeError/ValueError: an unknown option or a bad value, naming it.
    """

    def make(target):
        if not (inspect.isclass(target) or inspect.isfunction(target)):
            raise TypeError(
                f"@serve.deployment must decorate a class or a function (got {type(target).__name__})"
            )
        opts = dict(options)
        name = opts.pop("name", None) or target.__name__
        return Deployment(target, name, _config.deployment_options(opts))

    if _func_or_class is not None:
        if options or not callable(_func_or_class):
            raise TypeError("@serve.deployment takes keyword options only, e.g. @serve.deployment(num_replicas=2)")
        return make(_func_or_class)
    return make
