"""Kahn's algorithm (DESIGN.md section 4 rule 5) compiled: every graph build runs it, and a pipelined
simulation builds its unrolled step (M copies of the graph) on every call, so a placer that judges many
splits builds many large graphs. Imported by `compgraph` when a graph is built, not when it is imported, so
that `devplace --help` does not pay for numba. Imports nothing of devplace."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def csr(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """CSR grouping of edge indices by `keys` (src or dst, each in 0..n-1): (ptr int64[n+1], edge indices grouped
    by key, each group in edge order). A counting sort, O(E + n): the stable argsort it replaces was most of a
    graph build's time on a pipeline's unrolled step."""
    ptr = np.zeros(n + 1, dtype=np.int64)
    for e in range(keys.shape[0]):
        ptr[keys[e] + 1] += 1
    for v in range(n):
        ptr[v + 1] += ptr[v]
    fill = ptr[:n].copy()
    order = np.empty(keys.shape[0], dtype=np.int64)
    for e in range(keys.shape[0]):
        order[fill[keys[e]]] = e
        fill[keys[e]] += 1
    return ptr, order


@njit(cache=True)
def first_of_parallel(dst: np.ndarray, num_nodes: int, succ_ptr: np.ndarray,
                      succ_edges: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """first[e] is False when an earlier edge joins the same (src, dst): parallel edges count once. Walks each
    node's out-edges (`succ_ptr`/`succ_edges`, in edge order), marking a destination seen from that node: O(E)."""
    first = np.zeros(dst.shape[0], dtype=np.bool_)
    seen_from = np.full(num_nodes, -1, dtype=np.int64)  # the last node whose out-edges reached each node
    for u in range(num_nodes):
        for k in range(succ_ptr[u], succ_ptr[u + 1]):
            e = succ_edges[k]
            if seen_from[dst[e]] != u:
                seen_from[dst[e]] = u
                first[e] = True
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
