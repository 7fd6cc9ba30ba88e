"""Where the learned placers start: the best of a few classic placements (issue 13 item 3)."""

from __future__ import annotations

import numpy as np

from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.placers.registry import place
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.placeto import PlacetoModel
from devplace.sim.result import SimResult

# the classic placers tried, each as `place(graph, cluster, placer=name, order="topo", seed=seed)` runs it
START_PLACERS = ("m-etf", "m-sct", "heft", "m-topo", "contiguous", "single")


def best_classic(graph: CompGraph, cluster: Cluster, model: DevplaceModel | PlacetoModel,
                 seed: int = 0) -> tuple[np.ndarray, SimResult, str]:
    """The fastest under `model` of START_PLACERS' placements (each fits under devplace, as `place` checks),
    with its result and the placer's name; ties go to the earlier in the list. A placer that finds nothing that
    fits is skipped; when none fits, the last one's error is raised (a NoFitError saying what would fit)."""
    found: tuple[np.ndarray, SimResult, str] | None = None
    failure: DevplaceError | None = None
    for name in START_PLACERS:
        try:
            devices = place(graph, cluster, placer=name, order="topo", seed=seed).to_array(graph,
                                                                                          cluster.num_devices)
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
