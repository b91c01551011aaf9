"""``tpuray.dag``: Ray's lazy task graphs (``f.bind``, ``InputNode``,
``MultiOutputNode``, ``execute``); see ``dag_node.py``."""

from tpuray.dag.dag_node import (
    ClassMethodNode,
    ClassNode,
    DAGInputData,
    DAGNode,
    FunctionNode,
    InputAttributeNode,
    InputNode,
    MultiOutputNode,
)

__all__ = [
    "ClassMethodNode",
    "ClassNode",
    "DAGInputData",
    "DAGNode",
    "FunctionNode",
    "InputAttributeNode",
    "InputNode",
    "MultiOutputNode",
]
