"""A ``ray`` package that is tpuray: ``import ray`` gives ``tpuray`` and ``import
ray.X.Y`` gives ``tpuray.X.Y``, so the compatibility scripts beside this folder run
unchanged (as the Ray scripts they are) under tpuray.

Only for ``python-sdk/tests/test_compat.py``, which puts this folder first on
``PYTHONPATH`` of each script it runs; never installed. A meta-path finder maps every
``ray.*`` module onto the ``tpuray.*`` module of the same path (the same module object,
so ``ray.util.queue.Empty is tpuray.util.queue.Empty``); a module tpuray lacks fails to
import as it would with the name ``tpuray.*`` in the message.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys

import tpuray


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import machinery set the alias's spec on the module: give its own back.
        module.__spec__ = self.spec


class _RayToTpuray(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("ray."):
            return None
        real = "tpuray" + fullname[len("ray"):]
        importlib.import_module(real)  # raises ModuleNotFoundError naming tpuray.*
        return importlib.machinery.ModuleSpec(fullname, _Alias(real))


sys.meta_path.insert(0, _RayToTpuray())
sys.modules[__name__] = tpuray
