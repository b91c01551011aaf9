"""Ray's ``ray.dag.input_node`` import path; the classes live in ``dag_node.py``."""

from tpuray.dag.dag_node import InputNode, InputAttributeNode, DAGInputData  # noqa: F401
