"""Kahn's algorithm (DESIGN.md section 4 rule 5) compiled: every graph build runs it, and a pipelined
simulation builds its unrolled step (M copies of the graph) on every call, so a placer that judges many
splits builds many large graphs. Imported by `compgraph` when a graph is built, not when it is imported, so
that `devplace --help` does not pay for numba. Imports nothing of devplace."""

from __future__ import annotations

import numpy as np
from numba import njit


def first_of_parallel(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> np.ndarray:
    """first[e] is False when an earlier edge joins the same (src, dst): parallel edges count once."""
    first = np.zeros(src.shape[0], dtype=np.bool_)
    if src.shape[0]:
        _, at = np.unique(src.astype(np.int64) * max(num_nodes, 1) + dst, return_index=True)  # first occurrences
        first[at] = True
    return first


@njit(cache=True)
def kahn_fifo(num_nodes: int, dst: np.ndarray, succ_ptr: np.ndarray, succ_edges: np.ndarray,
              first: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Kahn with a FIFO queue, sources in insertion order, successors in edge order, counting only the edges
    marked `first`; fewer than `num_nodes` nodes when there is a cycle."""
    deg = np.zeros(num_nodes, dtype=np.int64)
    for e in range(dst.shape[0]):
        if first[e]:
            deg[dst[e]] += 1
    order = np.empty(num_nodes, dtype=np.int64)
    tail = 0
    for v in range(num_nodes):
        if deg[v] == 0:
            order[tail] = v
            tail += 1
    head = 0
    while head < tail:
        u = order[head]
        head += 1
        for k in range(succ_ptr[u], succ_ptr[u + 1]):
            e = succ_edges[k]
            if first[e]:
                w = dst[e]
                deg[w] -= 1
                if deg[w] == 0:
                    order[tail] = w
                    tail += 1
    return order[:tail]
