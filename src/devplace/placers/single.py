"""`single`: the whole step on one device, the fastest one whose memory holds it.

Optimises: compute speed only (no communication at all). Does **not** use `order` (nothing is walked).
Devices are tried by descending speed, ties by device index; each candidate is checked with the
`devplace` simulator (all ops on it, `SimResult.feasible`). If no single device holds the step, it
raises NoFitError. No settings.
"""

from __future__ import annotations

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, op_times
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import register
from devplace.sim.devplace_model import DevplaceModel
from devplace.units import fmt_bytes


@register("single", uses_order=False)
def single(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int) -> np.ndarray:
    """All ops on the fastest device that holds the whole step (checked with the simulator).

    Does not use the traversal order. No settings.
    """
    model = DevplaceModel(graph, cluster)
    serial = op_times(graph, cluster).sum(axis=0)  # the whole step's compute on each device
    by_speed = sorted(range(cluster.num_devices), key=lambda d: (serial[d], d))
    peaks = []
    for d in by_speed:
        devices = np.full(graph.num_nodes, d, dtype=np.int64)
        result = model.run(devices)
        if result.feasible:
            return devices
        peaks.append(float(result.peak_memory_bytes[d]))
    raise no_fit_error(graph, cluster, "single", f"the step needs {fmt_bytes(min(peaks))} on one device and "
                       f"the largest holds {fmt_bytes(float(cluster.memory.max()))}")
