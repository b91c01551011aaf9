"""Ray's ``ray.dag.output_node`` import path; the classes live in ``dag_node.py``."""

from tpuray.dag.dag_node import MultiOutputNode  # noqa: F401
