"""Basic size and shape figures of a graph, for `devplace info`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from devplace.graph.compgraph import CompGraph


def asap_levels(graph: CompGraph) -> np.ndarray:
    """level[v] = hops on the longest path from any source to v (sources are level 0)."""
    level = np.zeros(graph.num_nodes, dtype=np.int64)
    src = graph.edge_src.tolist()
    ptr, in_edges = graph.pred_ptr.tolist(), graph.pred_edges.tolist()
    lv = level.tolist()
    for v in graph.topo_order.tolist():
        for k in range(ptr[v], ptr[v + 1]):
            lv[v] = max(lv[v], lv[src[in_edges[k]]] + 1)
    return np.asarray(lv, dtype=np.int64)


def longest_path(graph: CompGraph, weights: Sequence[float]) -> list[int]:
    """Nodes of one longest path by the sum of `weights` over its nodes (no edge weights), in path order;
    ties go to the earliest predecessor in edge order and the earliest end in insertion order."""
    src = graph.edge_src.tolist()
    ptr, in_edges = graph.pred_ptr.tolist(), graph.pred_edges.tolist()
    dist = [0.0] * graph.num_nodes  # longest path ending at v, v included
    via = [-1] * graph.num_nodes
    for v in graph.topo_order.tolist():
        best, arg = 0.0, -1
        for k in range(ptr[v], ptr[v + 1]):
            u = src[in_edges[k]]
            if arg < 0 or dist[u] > best:
                best, arg = dist[u], u
        dist[v] = best + weights[v]
        via[v] = arg
    if not dist:
        return []
    end = max(range(len(dist)), key=dist.__getitem__)
    path = []
    while end >= 0:
        path.append(end)
        end = via[end]
    return path[::-1]


def graph_info(graph: CompGraph) -> dict[str, Any]:
    """Counts, totals and depth of `graph` as a JSON-ready dict."""
    indeg = np.bincount(graph.edge_dst, minlength=graph.num_nodes)
    outdeg = np.bincount(graph.edge_src, minlength=graph.num_nodes)
    levels = asap_levels(graph)
    return {
        "name": graph.name,
        "nodes": graph.num_nodes,
        "edges": graph.num_edges,
        "sources": int(np.count_nonzero(indeg == 0)),
        "sinks": int(np.count_nonzero(outdeg == 0)),
        "depth_hops": int(levels.max()) if graph.num_nodes else 0,
        "kinds": dict(sorted(Counter(k or "(none)" for k in graph.kind).items())),
        "total_compute_s": float(graph.compute_s.sum()),
        "total_param_bytes": float(graph.param_bytes.sum()),
        "total_output_bytes": float(graph.output_bytes.sum()),
        "total_edge_bytes": float(graph.edge_bytes.sum()),
        "max_temp_bytes": float(graph.temp_bytes.max()) if graph.num_nodes else 0.0,
    }
