"""The lower bound of DESIGN.md section 8: no placement and schedule can beat it."""

from __future__ import annotations

from dataclasses import dataclass

from devplace.graph.compgraph import CompGraph
from devplace.graph.info import longest_path
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
    path = longest_path(graph, t)
    cp = sum(t[v] for v in path)
    return LowerBound(value_s=max(work, cp), work_s=work, critical_path_s=cp, critical_path=tuple(path))
