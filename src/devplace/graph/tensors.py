"""A node's out-edges grouped by tensor: one group per (producer, tensor index) that has edges.

A tensor is sent once to every device that consumes it, however many edges carry it (DESIGN.md section 4),
so the simulators and the list schedulers all work per group. `tensor_groups(graph)` computes the grouping
once; all edges of a group have the same bytes (`CompGraph.build` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from devplace.graph.compgraph import CompGraph


@dataclass(frozen=True)
class TensorGroups:
    """The out-edges of a graph grouped by (producer, tensor index), groups numbered in that order.

    - `edges`: int64[E], every edge index sorted by (producer, tensor index, edge order); the out-edges of
      node v are the slice `succ_ptr[v]:succ_ptr[v + 1]` of it, as in `CompGraph.succ_edges`;
    - `edge_group`: int64[E], the group of each edge (indexed by edge);
    - `first_edge`: int64[G], the first edge (in edge order) of each group;
    - `ptr`: int64[V+1], the groups of producer v are `ptr[v]:ptr[v + 1]`.
    """

    edges: np.ndarray
    edge_group: np.ndarray
    first_edge: np.ndarray
    ptr: np.ndarray

    @property
    def num_groups(self) -> int:
        """G, the number of (producer, tensor index) pairs with at least one edge."""
        return int(self.first_edge.shape[0])


def tensor_groups(graph: CompGraph) -> TensorGroups:
    """Group `graph`'s out-edges by (producer, tensor index); see `TensorGroups`. O(E log E)."""
    src, tensor = graph.edge_src, graph.edge_tensor
    n_e = graph.num_edges
    # each producer's out-edges (edge order) sorted by tensor index, stably: np.lexsort((tensor, src)), without
    # sorting what the CSR has grouped already (every simulation of a pipelined step groups 10^4-10^5 edges)
    edges = sorted_within(graph.succ_ptr, graph.succ_edges, tensor, np.zeros(n_e, dtype=np.int64))
    new = np.ones(n_e, dtype=bool)
    if n_e:
        new[1:] = (src[edges][1:] != src[edges][:-1]) | (tensor[edges][1:] != tensor[edges][:-1])
    edge_group = np.empty(n_e, dtype=np.int64)
    edge_group[edges] = np.cumsum(new) - 1
    first_edge = edges[new]
    ptr = np.zeros(graph.num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(src[first_edge], minlength=graph.num_nodes), out=ptr[1:])
    return TensorGroups(edges, edge_group, first_edge, ptr)


SHORT = 32  # slices up to this long are sorted by insertion (most nodes have a few edges), longer ones by merge sort


@njit(cache=True)
def sorted_within(ptr: np.ndarray, items: np.ndarray, major: np.ndarray,
                  minor: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """`items` (int64, indices into `major` and `minor`) with each slice `ptr[v]:ptr[v + 1]` sorted stably by
    (major, minor) of its items: on a CSR of edge indices (each slice in edge order), the edges sorted by
    (node, major, minor, edge order), as np.lexsort((minor, major, node)) sorts them."""
    out = items.copy()
    for v in range(ptr.shape[0] - 1):
        lo, hi = ptr[v], ptr[v + 1]
        if hi - lo <= SHORT:
            for a in range(lo + 1, hi):
                x = out[a]
                b = a - 1
                while b >= lo and (major[out[b]] > major[x]
                                   or (major[out[b]] == major[x] and minor[out[b]] > minor[x])):
                    out[b + 1] = out[b]
                    b -= 1
                out[b + 1] = x
        else:
            part = out[lo:hi].copy()
            part = part[np.argsort(minor[part], kind="mergesort")]
            out[lo:hi] = part[np.argsort(major[part], kind="mergesort")]
    return out
