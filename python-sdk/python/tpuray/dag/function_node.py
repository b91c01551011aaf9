"""Ray's ``ray.dag.function_node`` import path; the classes live in ``dag_node.py``."""

from tpuray.dag.dag_node import FunctionNode  # noqa: F401
