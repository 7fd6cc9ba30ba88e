"""`random`: every node on a uniformly random device.

Optimises nothing: a baseline. Does **not** use `order` (devices are drawn for node indices 0..V-1, so
the result is the same for every order). Randomness: `numpy.random.Generator(PCG64(seed))`; placement j
is the j-th draw of `rng.integers(0, k, V)`. Setting `tries` (default 20): draw up to `tries` placements
and return the first one the `devplace` simulator finds memory-feasible; if none is, NoFitError.
"""

from __future__ import annotations

import numpy as np

from devplace.defaults import MAX_SEARCH_STEPS
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.placers.common import describe_oom, positive_int
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import register
from devplace.sim.devplace_model import DevplaceModel


def _check_settings(tries: int) -> int:
    return positive_int(tries, "tries", "random", MAX_SEARCH_STEPS)


@register("random", uses_order=False, check=_check_settings)
def random_placement(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int,
                     tries: int = 20) -> np.ndarray:
    """A uniformly random device per node (PCG64(seed)); the first of `tries` draws that fits memory.

    Does not use the traversal order. Settings: `tries` (int >= 1, default 20).
    """
    tries = _check_settings(tries)
    rng = np.random.Generator(np.random.PCG64(seed))
    model = DevplaceModel(graph, cluster)
    result = None
    for _ in range(tries):
        devices = rng.integers(0, cluster.num_devices, graph.num_nodes, dtype=np.int64)
        result = model.run(devices)
        if result.feasible:
            return devices
    assert result is not None
    raise no_fit_error(graph, cluster, "random", f"none of {tries} random placements fits (the last is over "
                       f"memory on {describe_oom(result)})")
