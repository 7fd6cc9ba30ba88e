"""A node's out-edges grouped by tensor: one group per (producer, tensor index) that has edges.

A tensor is sent once to every device that consumes it, however many edges carry it (DESIGN.md section 4),
so the simulators and the list schedulers all work per group. `tensor_groups(graph)` computes the grouping
once; all edges of a group have the same bytes (`CompGraph.build` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    edges = np.lexsort((tensor, src)).astype(np.int64)  # stable: edge order within a group
    new = np.ones(n_e, dtype=bool)
    if n_e:
        new[1:] = (src[edges][1:] != src[edges][:-1]) | (tensor[edges][1:] != tensor[edges][:-1])
    edge_group = np.empty(n_e, dtype=np.int64)
    edge_group[edges] = np.cumsum(new) - 1
    first_edge = edges[new]
    ptr = np.zeros(graph.num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(src[first_edge], minlength=graph.num_nodes), out=ptr[1:])
    return TensorGroups(edges, edge_group, first_edge, ptr)
