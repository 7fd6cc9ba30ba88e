"""Where the learned placers start, and how their answer is judged on the graph that runs.

A learned placer decides units: the nodes of the graph `devplace.place` hands it -- the graph itself when it is
placed op by op, the folded graph (one node per tie class) when it is placed as autograd runs
(`devplace.graph.semantics`). Its start placements are placements of those units, so the classic placers it
starts from place that graph op by op whatever the original graph's semantics (issue 22: they used to apply
the autograd rule again to a graph the caller had placed op by op, and started from a worse placement).

Its answer is judged on the graph that runs (`FullGraph`: the original graph and the map from unit devices to
its devices), among the learned placement, the start and every single device that fits, so it is never worse
there than its start, nor than one device where one device fits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from devplace.defaults import SIM_DEVPLACE
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.graph.semantics import Semantics
from devplace.hardware.cluster import Cluster
from devplace.placers.registry import FullGraph
from devplace.placers.search import place
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.placeto import PlacetoModel
from devplace.sim.result import SimResult

# the classic placers tried, each as `place(graph, cluster, placer=name, order="topo", seed=seed)` runs it
START_PLACERS = ("m-etf", "m-sct", "heft", "m-topo", "contiguous", "single")


def best_classic(graph: CompGraph, cluster: Cluster, model: DevplaceModel | PlacetoModel,
                 seed: int = 0) -> tuple[np.ndarray, SimResult, str]:
    """The fastest under `model` of START_PLACERS' placements of `graph`'s nodes, each placed op by op (they are
    the learned placer's units; each fits under devplace, as `place` checks), with its result and the placer's
    name; ties go to the earlier in the list. A placer that finds nothing that fits is skipped; when none fits,
    the last one's error is raised (a NoFitError saying what would fit)."""
    found: tuple[np.ndarray, SimResult, str] | None = None
    failure: DevplaceError | None = None
    for name in START_PLACERS:
        try:
            devices = place(graph, cluster, placer=name, order="topo", seed=seed,
                            semantics=Semantics.OP_BY_OP).to_array(graph, cluster.num_devices)
        except DevplaceError as exc:  # this placer found nothing that fits: the others may
            failure = exc
            continue
        result = model.run(devices)
        if found is None or result.step_time_s < found[1].step_time_s:
            found = (devices, result, name)
    if found is None:
        assert failure is not None
        raise failure
    return found


class Judge:
    """Step times of unit placements on `full.graph` under `sim_model`, infinite for one over memory there
    under the devplace model (what `place` checks)."""

    def __init__(self, full: FullGraph, cluster: Cluster, sim_model: str) -> None:
        self.full, self.num_devices = full, cluster.num_devices
        self.ref = DevplaceModel(full.graph, cluster)
        self.model = self.ref if sim_model == SIM_DEVPLACE else PlacetoModel(full.graph, cluster)

    def step(self, devices: np.ndarray) -> float:
        """The step time of `full.graph` under unit placement `devices`; inf when it is over memory."""
        expanded = self.full.expand(devices)
        if not self.ref.run(expanded).feasible:
            return float("inf")
        return float(self.model.run(expanded).step_time_s)

    def best(self, candidates: Sequence[np.ndarray]) -> tuple[np.ndarray, float]:
        """(unit devices, step time) of the fastest of `candidates` and every single device; ties keep the
        earlier. The first candidate (the placer's answer) is returned with an infinite time when nothing fits,
        so that `place` reports its overflow."""
        n_units = len(candidates[0])
        singles = [np.full(n_units, d, dtype=np.int64) for d in range(self.num_devices)]
        best: tuple[np.ndarray, float] = (np.asarray(candidates[0], dtype=np.int64), float("inf"))
        for devices in [*candidates, *singles]:
            step = self.step(devices)
            if step < best[1]:
                best = (np.asarray(devices, dtype=np.int64), step)
        return best


def judged_best(full: FullGraph, cluster: Cluster, sim_model: str, candidates: Sequence[np.ndarray],
                ) -> tuple[np.ndarray, float]:
    """`Judge(full, cluster, sim_model).best(candidates)`: the fastest on the full graph of `candidates` and
    every single device that fits there."""
    return Judge(full, cluster, sim_model).best(candidates)
