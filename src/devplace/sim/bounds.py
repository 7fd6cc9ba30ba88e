"""The lower bound of DESIGN.md section 8: no placement and schedule can beat it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster


@dataclass(frozen=True)
class LowerBound:
    """`value_s` = max(`work_s`, `critical_path_s`); `critical_path` lists the node indices of one longest path."""

    value_s: float
    work_s: float  # total compute / total speed: every device busy all the time
    critical_path_s: float  # longest path at the fastest speed, no communication
    critical_path: tuple[int, ...]

    @property
    def limited_by(self) -> str:
        return "critical path" if self.critical_path_s >= self.work_s else "total work"


def lower_bound(graph: CompGraph, cluster: Cluster) -> LowerBound:
    """LB = max(sum compute / sum speeds, critical path at the fastest speed without communication)."""
    speeds = cluster.speeds
    work = float(graph.compute_s.sum() / speeds.sum())
    t = (graph.compute_s / speeds.max()).tolist()
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
        dist[v] = best + t[v]
        via[v] = arg
    if not dist:
        return LowerBound(0.0, 0.0, 0.0, ())
    end = int(np.argmax(dist))
    path = []
    while end >= 0:
        path.append(end)
        end = via[end]
    cp = max(dist)
    return LowerBound(value_s=max(work, cp), work_s=work, critical_path_s=cp, critical_path=tuple(path[::-1]))
