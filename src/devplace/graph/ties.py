"""Tie classes: sets of nodes that must run on one device, as autograd runs a training step.

Autograd runs a backward op on the device where its forward op ran, and an optimizer op where its parameter
lives (with the forward op that first uses it); an input is fed to the device of its first consumer. A
placement that splits such a set is not what PyTorch executes, so the placers treat every set as one decision.

Where the sets come from:

- a full captured graph: a node whose `kind` is not "forward" and whose `group` names a "forward" node is tied
  to that node; a node with `op == "input"` is tied to its first successor;
- a coarse graph (one with coarsening meta): coarse nodes carry a "tie" label (an extra key, written by
  `devplace.graph.coarsen`), equal labels meaning one set; `group`/`kind` there describe mixed groups and are
  not used;
- any graph: nodes with the same non-empty "tie" label are tied.

A graph without groups, kinds or labels (a hand-written JSON graph, say) has every node in a class of its own.
"""

from __future__ import annotations

import numpy as np

from devplace.graph.compgraph import CompGraph

TIE_KEY = "tie"  # node extra key: nodes with equal non-empty labels run on one device
COARSENING_META_KEY = "coarsening"  # the meta key `devplace.graph.coarsen` writes (kept equal to its META_KEY)


def _find(parent: list[int], x: int) -> int:
    root = x
    while parent[root] != root:
        root = parent[root]
    while parent[x] != root:
        parent[x], x = root, parent[x]
    return root


def _union(parent: list[int], a: int, b: int) -> None:
    ra, rb = _find(parent, a), _find(parent, b)
    if ra != rb:  # the smaller index stays the root, so class numbering follows insertion order
        parent[max(ra, rb)] = min(ra, rb)


def tie_classes(graph: CompGraph) -> np.ndarray:
    """Class index per node (int64[V], classes numbered 0..K-1 in order of their first node): nodes of one
    class must be placed on one device for the placement to be what autograd runs (see the module docstring)."""
    n = graph.num_nodes
    parent = list(range(n))
    labels: dict[str, int] = {}
    for v, extra in enumerate(graph.node_extra):
        label = extra.get(TIE_KEY)
        if isinstance(label, str) and label:
            first = labels.setdefault(label, v)
            if first != v:
                _union(parent, first, v)
    if COARSENING_META_KEY not in graph.meta:
        index = graph.index
        for v in range(n):
            if graph.kind[v] and graph.kind[v] != "forward" and graph.group[v]:
                u = index.get(graph.group[v])
                if u is not None and u != v and graph.kind[u] == "forward":
                    _union(parent, v, u)
            if graph.op[v] == "input":
                succ = graph.successors(v)
                if succ:
                    _union(parent, v, succ[0])
    roots = np.fromiter((_find(parent, v) for v in range(n)), dtype=np.int64, count=n)
    _, classes = np.unique(roots, return_inverse=True)  # roots are first members: numbering by first node
    return classes.astype(np.int64).reshape(n)


def is_tied(graph: CompGraph) -> bool:
    """True when some class of `tie_classes(graph)` has more than one node."""
    classes = tie_classes(graph)
    return bool(classes.size) and int(classes.max()) + 1 < classes.size


def untied(graph: CompGraph) -> np.ndarray:
    """Every node in a class of its own: what placers get when the autograd rule is switched off."""
    return np.arange(graph.num_nodes, dtype=np.int64)


def violations(graph: CompGraph, devices: np.ndarray, classes: np.ndarray) -> list[int]:
    """Nodes whose device differs from the device of the first node of their class."""
    first: dict[int, int] = {}
    bad: list[int] = []
    for v in range(graph.num_nodes):
        c = int(classes[v])
        f = first.setdefault(c, v)
        if devices[v] != devices[f]:
            bad.append(v)
    return bad
