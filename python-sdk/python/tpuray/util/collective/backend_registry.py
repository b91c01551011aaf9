"""Which collective backends exist in this process (Ray's
``ray.util.collective.backend_registry``)."""

from __future__ import annotations

from tpuray.util.collective.collective_group.base_collective_group import BaseGroup


class BackendRegistry:
    """Backend name (upper case) -> group class; one per process."""

    _instance: BackendRegistry | None = None
    _map: dict[str, type[BaseGroup]]
    #: Built-in backend name -> why it is not registered here.
    _absent: dict[str, str]

    def __new__(cls) -> BackendRegistry:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._map = {}
            cls._instance._absent = {}
        return cls._instance

    def put(self, name: str, group_cls) -> None:
        if not (isinstance(group_cls, type) and issubclass(group_cls, BaseGroup)):
            raise TypeError(f"{group_cls} is not a subclass of BaseGroup")
        if name.upper() in self._map:
            raise ValueError(f"Backend {name.upper()} already registered")
        self._map[name.upper()] = group_cls

    def mark_absent(self, name: str, why: str) -> None:
        """Records why a built-in backend is not registered here (said when asked for)."""
        self._absent[name.upper()] = why

    def why_absent(self, name: str) -> str:
        return self._absent.get(name.upper(), "")

    def get(self, name: str) -> type[BaseGroup]:
        """The group class of ``name``.

        Raises:
            ValueError: ``name`` is not registered (saying why, for a built-in one).
        """
        upper = name.upper()
        if upper not in self._map:
            why = self._absent.get(upper)
            raise ValueError(f"Backend {upper} not registered" + (f": {why}" if why else ""))
        return self._map[upper]

    def is_registered(self, name: str) -> bool:
        return name.upper() in self._map

    def check(self, name: str) -> bool:
        """Whether ``name`` is registered and available in this process."""
        try:
            return bool(self.get(name).check_backend_availability())
        except (ValueError, AttributeError):
            return False


_global_registry = BackendRegistry()


def register_collective_backend(name: str, group_cls) -> None:
    """Adds a backend: ``group_cls`` (a ``BaseGroup`` subclass) serves groups created
    with ``backend=name``. Register it in the driver and in every member process.

    Raises:
        TypeError: ``group_cls`` is not a ``BaseGroup``.
        ValueError: ``name`` is registered already.
    """
    _global_registry.put(name, group_cls)
    from tpuray.util.collective import types

    if not hasattr(types.Backend, name.upper()):
        setattr(types.Backend, name.upper(), name.upper())
