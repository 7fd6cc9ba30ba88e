"""`greedy` ✱: walk the graph in the traversal order; put each op on the device that minimises the simulated
step time of the partial placement so far.

The partial placement after visiting k ops is simulated as the subgraph *induced* by those k ops
(`DevplaceModel.run(devices, active)`: unvisited ops and every edge touching one are left out), so the
choice for an op sees exactly the ops placed before it in the order -- which is why the order matters:
`topo` grows the graph from its sources and places each op next to its inputs, `reversed-topo` grows it
from its sinks, `dfs-preorder` finishes one branch before the next, and so on.

Cost: V x D simulations (every op tried on every device), the k-th of a subgraph of k ops; the compiled
simulator's per-run work is O((V + E) log V), so the placer is O(V^2 D log V) overall: about 4,000
simulations for 1,000 ops on 4 devices (a few seconds on a slow laptop core), 40,000 for 10,000 ops
(several minutes: coarsen big graphs first, or use `m-etf`/`heft`).
"""

from __future__ import annotations

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.graph.ties import untied
from devplace.hardware.cluster import Cluster
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import Progress, register
from devplace.sim.devplace_model import DevplaceModel
from devplace.units import fmt_bytes


@register("greedy", uses_order=True, cheap=True, quadratic=True)
def greedy(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int = 0,
           progress: Progress | None = None, ties: np.ndarray | None = None) -> np.ndarray:
    """Visit ops in the order; put each on the device giving the shortest simulated step time of the partial placement.

    The partial placement is the subgraph induced by the ops visited so far, simulated with the `devplace`
    model; only devices that keep it memory-feasible are candidates, and ties go to the lowest device
    index. Deterministic: `seed` is not used. Cost: V x D simulations of growing subgraphs, O(V^2 D log V).
    Raises NoFitError when no device can take an op without running out of memory. `ties` (given by `place`
    under the autograd rule): the first op of a tie class visited chooses the device, the class's later ops go
    where it went.
    """
    n, nd = graph.num_nodes, cluster.num_devices
    devices = np.zeros(n, dtype=np.int64)
    if n == 0:
        return devices
    model = DevplaceModel(graph, cluster)
    tie = untied(graph) if ties is None else np.asarray(ties, dtype=np.int64)
    class_device = np.full(int(tie.max()) + 1, -1, dtype=np.int64)  # set by the first op of each class placed
    active = np.zeros(n, dtype=np.bool_)
    for i, v in enumerate(np.asarray(order, dtype=np.int64).tolist()):
        if progress is not None:
            progress(i, n)
        active[v] = True
        pinned = int(class_device[tie[v]])
        best_d, best_t = -1, np.inf
        least_over, least_d = np.inf, 0
        for d in range(nd) if pinned < 0 else (pinned,):
            devices[v] = d
            result = model.run(devices, active)
            if result.feasible:
                if result.step_time_s < best_t:
                    best_d, best_t = d, result.step_time_s
            else:
                over = float((result.peak_memory_bytes - result.memory_bytes).max())
                if over < least_over:
                    least_over, least_d = over, d
        if best_d < 0:
            placed = int(active.sum())
            where = "no device" if pinned < 0 else f"the device of its tie class, {pinned},"
            raise no_fit_error(
                graph, cluster, "greedy",
                f"after placing {placed - 1} of {n} ops in the traversal order, op {graph.ids[v]!r} fits on {where} "
                f"(on device {least_d} the partial placement would be {fmt_bytes(least_over)} over memory)")
        devices[v] = best_d
        class_device[tie[v]] = best_d
    return devices
