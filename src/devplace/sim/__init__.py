"""Simulation of one training step under a placement: the `devplace` reference model (DESIGN.md section 4),
the `placeto-sim` model (the Placeto paper's simulator, section 5; `placeto` is its old name), the lower bound
(section 8) and timelines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from devplace.defaults import (
    DEFAULT_SIM_MODEL,
    SIM_DEVPLACE,
    SIM_MODEL_ALIASES,
    SIM_MODELS,
    SIM_PLACETO,
    sim_model_name,
)
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.graph.placement import Placement
from devplace.hardware.cluster import Cluster
from devplace.sim.bounds import LowerBound, any_schedule_bound, lower_bound
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.result import SimResult, Transfers
from devplace.sim.schedule import Schedule, ScheduledResult, ScheduleError, simulate_schedule

MODELS = (*SIM_MODELS, *SIM_MODEL_ALIASES)
"""Every name `simulate(model=...)` accepts: the models' names, then their old aliases."""


PlacementLike = Placement | np.ndarray | Sequence[int]


def placement_array(graph: CompGraph, cluster: Cluster, placement: PlacementLike) -> np.ndarray:
    """Device index per node (node order) from a Placement or an array, checked against graph and cluster."""
    if isinstance(placement, Placement):
        return placement.to_array(graph, cluster.num_devices)
    return Placement.from_array(graph, placement).to_array(graph, cluster.num_devices)


def simulate(
    graph: CompGraph, cluster: Cluster, placement: PlacementLike, *, model: str = DEFAULT_SIM_MODEL,
    schedule: Schedule | None = None, **params: Any
) -> SimResult:
    """Simulate one training step of `graph` on `cluster` under `placement`.

    `model` is "devplace" (the reference model, DESIGN.md section 4) or "placeto-sim" (the Placeto paper's
    simulator, section 5, which takes `delta1_s`, `delta2_s` and `bus_Bps`; "placeto" is its old name). With a
    `schedule` (devplace model only), the step is pipelined: forward and backward ops run once per micro-batch in
    the schedule's order (docs/simulation.md, "Pipeline schedules"), and the result is a ScheduledResult.
    """
    devices = placement_array(graph, cluster, placement)
    model = sim_model_name(model)
    if schedule is not None and not isinstance(schedule, Schedule):
        raise ScheduleError(f"schedule must be a devplace.sim.Schedule or None, got {schedule!r}")
    if schedule is not None and model != SIM_DEVPLACE:
        raise ScheduleError(f"schedules are simulated with the devplace model only, not {model!r}")
    if model == SIM_DEVPLACE:
        if params:
            raise DevplaceError(f"the devplace model takes no parameters, got {', '.join(params)}")
        if schedule is not None:
            return simulate_schedule(graph, cluster, devices, schedule)
        return DevplaceModel(graph, cluster).run(devices)
    if model == SIM_PLACETO:
        from devplace.sim.placeto import simulate_placeto

        allowed = {"delta1_s", "delta2_s", "bus_Bps"}
        if set(params) - allowed:
            raise DevplaceError(f"the placeto model takes {', '.join(sorted(allowed))}; got "
                                f"{', '.join(sorted(set(params) - allowed))}")
        return simulate_placeto(graph, cluster, devices, **params)
    raise DevplaceError(f"unknown simulation model {model!r}; choose one of: {', '.join(SIM_MODELS)}")


__all__ = ["MODELS", "DevplaceModel", "LowerBound", "Schedule", "ScheduleError", "ScheduledResult", "SimResult",
           "Transfers", "any_schedule_bound", "lower_bound", "placement_array", "simulate"]
