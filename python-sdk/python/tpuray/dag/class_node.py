"""Ray's ``ray.dag.class_node`` import path; the classes live in ``dag_node.py``."""

from tpuray.dag.dag_node import ClassNode, ClassMethodNode  # noqa: F401
