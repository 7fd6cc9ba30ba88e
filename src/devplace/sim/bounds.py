"""The lower bound of DESIGN.md section 8: no placement and op schedule can beat it; for a pipelined step
(a micro-batch `Schedule`) the bound of the step that schedule runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.graph.info import longest_path
from devplace.hardware.cluster import Cluster
from devplace.sim.schedule import PER_STEP, Schedule, op_phases


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


def lower_bound(graph: CompGraph, cluster: Cluster, schedule: Schedule | None = None) -> LowerBound:
    """LB = max(sum compute / sum speeds, critical path at the fastest speed without communication).

    With a micro-batch `schedule`, the bound of the step that schedule runs (docs/simulation.md, "Pipeline
    schedules"): forward and backward ops run M times at 1/M of their compute (at all of it for a
    `microbatch_graph`, captured at batch/M), per-step ops once. The work is the unrolled step's; the critical
    path is one micro-batch's ops followed by per-step ops, which the unrolled step holds for its last
    micro-batch."""
    speeds = cluster.speeds
    compute = graph.compute_s
    work_compute = compute
    if schedule is not None:
        per_mb = op_phases(graph) != PER_STEP
        m = schedule.microbatches
        if schedule.microbatch_graph:
            work_compute = np.where(per_mb, compute * m, compute)
        else:
            compute = np.where(per_mb, compute / m, compute)
    work = float(work_compute.sum() / speeds.sum())
    t = (compute / speeds.max()).tolist()
    path = longest_path(graph, t)
    cp = sum(t[v] for v in path)
    return LowerBound(value_s=max(work, cp), work_s=work, critical_path_s=cp, critical_path=tuple(path))
