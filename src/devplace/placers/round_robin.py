"""`round-robin` ✱: the i-th node of the traversal order goes to device i mod k.

Optimises nothing: it is the baseline that spreads ops evenly by count. Uses `order` (that is all it
uses). The placement is checked with the `devplace` simulator and never repaired: if it is over memory,
NoFitError. No settings.
"""

from __future__ import annotations

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.placers.common import describe_oom
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import register
from devplace.sim.devplace_model import DevplaceModel


@register("round-robin", uses_order=True, cheap=True)
def round_robin(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int) -> np.ndarray:
    """The i-th node in the traversal order on device i mod k (a baseline; over memory is an error).

    Uses the traversal order. No settings.
    """
    devices = np.empty(graph.num_nodes, dtype=np.int64)
    devices[order] = np.arange(graph.num_nodes, dtype=np.int64) % cluster.num_devices
    result = DevplaceModel(graph, cluster).run(devices)
    if not result.feasible:
        raise no_fit_error(graph, cluster, "round-robin",
                           f"the round-robin placement is over memory on {describe_oom(result)}")
    return devices
