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
- a folded graph (`fold`, one node per class): no ties;
- any graph: nodes with the same non-empty "tie" label are tied.

A graph without groups, kinds or labels (a hand-written JSON graph, say) has every node in a class of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from devplace.graph.compgraph import KIND_COMPUTE_KEY, CompGraph
from devplace.graph.modules import SEGMENTS_KEY, group_segments, segment_spans
from devplace.graph.phases import accumulation_record, merged_accumulation, merged_step_compute, per_kind, step_record

TIE_KEY = "tie"  # node extra key: nodes with equal non-empty labels run on one device
COARSENING_META_KEY = "coarsening"  # the meta key `devplace.graph.coarsen` writes (kept equal to its META_KEY)
FOLDED_META_KEY = "folded"  # the meta key `fold` writes: {"from": graph name, "classes": count}
OP_FOLDED = "tied"  # the `op` of a folded node with more than one member
SUMMED_EXTRAS = ("flops", "mem_access_bytes")  # numeric extra keys summed over a coarse group's or class's members


@njit(cache=True)
def _roots(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Per node of 0..n-1, the least node of its set, the pairs (a[i], b[i]) joined (union-find): a set's root is
    its least member whatever the order of the joins, so classes number by their first node."""
    parent = np.arange(n)
    for i in range(a.shape[0]):
        ra, rb = a[i], b[i]
        while parent[ra] != ra:
            ra = parent[ra]
        while parent[rb] != rb:
            rb = parent[rb]
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    for v in range(n):  # parents are less than their children: each node's root is its parent's
        parent[v] = parent[parent[v]]
    return parent


def tie_classes(graph: CompGraph) -> np.ndarray:
    """Class index per node (int64[V], read-only; classes numbered 0..K-1 in order of their first node): nodes of
    one class must be placed on one device for the placement to be what autograd runs (see the module
    docstring). Computed once per graph (`CompGraph.derived`)."""
    return graph.derived("tie_classes", _tie_classes)


def tie_classes_extended(graph: CompGraph, base: CompGraph) -> None:
    """Store `graph`'s tie classes as `base`'s followed by a class of its own per appended node, without the pass
    over `graph`'s nodes: for a graph that is `base` (same ids, ops, groups, labels, meta; kinds the same, or
    changed from one kind that is neither "" nor "forward" to another, which the group rule treats alike) with
    nodes appended that carry no tie label, no group and no op "input" (the relay nodes of a pipelined step and
    a tied parameter's copies, built on every simulation of a split), where no group names an appended node's
    id and every "input" node keeps its first successor, which it is tied to. The caller checks that; the values
    are those `tie_classes(graph)` computes: no rule ties an appended node, and classes are numbered by first
    node."""
    classes = tie_classes(base)
    start = int(classes.max()) + 1 if classes.size else 0
    graph.derived("tie_classes", lambda _: np.concatenate(
        [classes, start + np.arange(graph.num_nodes - base.num_nodes, dtype=np.int64)]))


def _tie_classes(graph: CompGraph) -> np.ndarray:
    n = graph.num_nodes
    a: list[int] = []  # the pairs of nodes each rule ties, joined by `_roots`
    b: list[int] = []
    labels: dict[str, int] = {}
    for v, extra in enumerate(graph.node_extra):
        label = extra.get(TIE_KEY)
        if isinstance(label, str) and label:
            first = labels.setdefault(label, v)
            if first != v:
                a.append(first)
                b.append(v)
    if COARSENING_META_KEY not in graph.meta and FOLDED_META_KEY not in graph.meta:
        index, kind, group = graph.index, graph.kind, graph.group
        tied = per_kind(kind, lambda k: bool(k) and k != "forward", bool) & per_kind(group, bool, bool)
        for v in np.flatnonzero(tied).tolist():
            u = index.get(group[v])
            if u is not None and u != v and kind[u] == "forward":
                a.append(v)
                b.append(u)
        # an input with the dst of its first out-edge (its first successor)
        inputs = np.flatnonzero(per_kind(graph.op, lambda op: op == "input", bool)
                                & (graph.succ_ptr[1:] > graph.succ_ptr[:-1]))
        a.extend(inputs.tolist())
        b.extend(graph.edge_dst[graph.succ_edges[graph.succ_ptr[inputs]]].tolist())
    roots = _roots(n, np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))
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


@dataclass(frozen=True, eq=False)
class Folding:
    """A graph folded by its tie classes: `graph` has one node per class (node k is class k), `classes` maps
    each node of the original graph to its class, so `expand(devices)` places the original graph."""

    graph: CompGraph
    classes: np.ndarray

    def expand(self, devices: np.ndarray) -> np.ndarray:
        """The device per original node from a device per folded node (every class on one device)."""
        return np.asarray(devices, dtype=np.int64)[self.classes]


def fold(graph: CompGraph, classes: np.ndarray | None = None) -> Folding:
    """The DAG a placer decides tie classes on: one node per class of `classes` (default `tie_classes(graph)`).

    Contracting the classes of a training graph gives a cyclic quotient -- a layer's forward op and its
    backward op sandwich the loss -- so only the quotient edges that go forward in the topological rank of
    the classes' representatives (a class's member that comes first in the graph's canonical topological
    order; for a training graph, its forward op) are kept: the forward pass, with each layer's backward and
    optimizer work folded into it. The edges left out lie inside a class or run against that order (the
    gradient flowing back): the folded graph does not say that a layer's backward work waits for the later
    layers and the loss, so a placer's own simulation of it is optimistic about overlap, which is why
    `devplace.place` simulates and checks the expanded placement on the real graph.

    A folded node sums its members' compute_s (and per-kind times), param_bytes and output_bytes (and the extras
    flops/mem_access_bytes), so the time and memory of the tied ops count when its device is chosen;
    temp_bytes is the members' largest, as temporaries live only while their own op runs. Each original
    tensor that crosses classes forward stays one tensor of the folded producer (sent once per device, as in
    the simulator), with its bytes, one edge per consumer class.
    """
    if classes is None:
        classes = tie_classes(graph)
    classes = np.asarray(classes, dtype=np.int64)
    n = graph.num_nodes
    k = int(classes.max()) + 1 if n else 0
    rank = graph.topo_rank
    rep_rank = np.full(k, n, dtype=np.int64)
    np.minimum.at(rep_rank, classes, rank)
    rep = np.asarray(graph.topo_order)[rep_rank] if n else np.zeros(0, dtype=np.int64)
    size = np.bincount(classes, minlength=k)

    def summed(x: np.ndarray) -> np.ndarray:
        return np.bincount(classes, weights=x, minlength=k)

    compute, out_b, param_b = summed(graph.compute_s), summed(graph.output_bytes), summed(graph.param_bytes)
    by_kind = {kind: summed(col) for kind, col in graph.kind_compute.items()}
    step = merged_step_compute(graph, classes, k)
    acc = merged_accumulation(graph, classes, k)
    temp = np.zeros(k, dtype=np.float64)
    np.maximum.at(temp, classes, graph.temp_bytes)
    members: list[list[int]] = [[] for _ in range(k)]
    for v in range(n):
        members[int(classes[v])].append(v)
    spans = segment_spans(graph)
    nodes: list[dict[str, Any]] = []
    for c in range(k):
        r = int(rep[c])
        rec: dict[str, Any] = {"id": graph.ids[r], "op": graph.op[r] if size[c] == 1 else OP_FOLDED,
                               "kind": graph.kind[r], "compute_s": float(compute[c]),
                               "output_bytes": float(out_b[c]), "param_bytes": float(param_b[c]),
                               "temp_bytes": float(temp[c])}
        if by_kind:
            rec[KIND_COMPUTE_KEY] = {kind: float(col[c]) for kind, col in by_kind.items()}
        rec.update(step_record(step, c, graph.kind[r]))  # the class's optimizer update runs once per step
        rec.update(accumulation_record(acc, c))  # its members' adds of their gradients into .grad
        for key in SUMMED_EXTRAS:
            nums = [x for v in members[c] if isinstance(x := graph.node_extra[v].get(key), int | float)
                    and not isinstance(x, bool)] if graph.node_extra else []
            if nums:
                rec[key] = sum(nums)
        segments = group_segments(spans, members[c])  # where a pipeline may cut, as on a coarse graph
        if segments is not None:
            rec[SEGMENTS_KEY] = segments
        nodes.append(rec)
    src_c, dst_c = classes[graph.edge_src], classes[graph.edge_dst]
    forward = np.flatnonzero(rep_rank[src_c] < rep_rank[dst_c])
    tensor_of: dict[tuple[int, int], int] = {}  # (original producer, tensor) -> tensor index of its class
    per_class = np.zeros(k, dtype=np.int64)
    seen: set[tuple[int, int, int]] = set()
    edges: list[dict[str, Any]] = []
    for e in forward.tolist():
        u, cu, cv = int(graph.edge_src[e]), int(src_c[e]), int(dst_c[e])
        key = (u, int(graph.edge_tensor[e]))
        t = tensor_of.get(key)
        if t is None:
            t = tensor_of[key] = int(per_class[cu])
            per_class[cu] += 1
        if (cu, cv, t) in seen:
            continue
        seen.add((cu, cv, t))
        edges.append({"src": graph.ids[int(rep[cu])], "dst": graph.ids[int(rep[cv])],
                      "bytes": float(graph.edge_bytes[e]), "tensor": t})
    # the coarsening's group mapping does not describe the folded nodes; the folded marker keeps `tie_classes`
    # from re-tying them by the op/kind rules of a full graph
    meta = {key: val for key, val in graph.meta.items() if key != COARSENING_META_KEY}
    meta[FOLDED_META_KEY] = {"from": graph.name, "classes": k}
    return Folding(CompGraph.build(f"{graph.name}.folded{k}", nodes, edges, meta=meta), classes)
