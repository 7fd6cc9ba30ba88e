"""`m-topo` ✱: Baechi's m-TOPO (Jeon et al., SoCC 2020): fill device 0, then device 1, ... in the order.

Uses `order`: the nodes are walked in the traversal order (Baechi walks a topological order).

What it does, exactly:

1. Memory of an op = `param_bytes + output_bytes + temp_bytes` (Baechi's op memory).
2. Cap of device d = min(total op memory / k + the largest op's memory, memory of d): Baechi's rule
   (spread the ops evenly by memory, with one op of slack), never above what the device has.
3. Walk the order with a current device d (starting at 0) and the op memory `used` placed on it: a node
   goes on d if `used + memory(node) <= cap[d]`; otherwise d moves on to the next device (as many times
   as needed) and the node goes there. Nodes left after the last device: NoFitError.
4. Check the placement with the `devplace` simulator. The op-memory sum overestimates outputs and temps
   but does not count tensors a device receives, so a device can still be over memory. For every such
   device, its cap becomes (op memory placed on it) - (how far its simulated peak is over its capacity),
   which moves its last ops to later devices, and step 3 runs again; after `RETRIES` rounds that are
   still over memory, NoFitError.

Optimises: nothing beyond balance; it only packs memory. Cost: O(V) per round plus one simulation.
No settings.
"""

from __future__ import annotations

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.placers.common import describe_oom, op_memory
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import register
from devplace.sim.devplace_model import DevplaceModel

RETRIES = 10  # cap reductions after the first placement, at most


def baechi_caps(graph: CompGraph, cluster: Cluster) -> np.ndarray:
    """Per-device cap on the op memory m-TOPO puts there: min(total / k + largest op, capacity)."""
    mem = op_memory(graph)
    rule = float(mem.sum()) / cluster.num_devices + (float(mem.max()) if graph.num_nodes else 0.0)
    return np.minimum(rule, cluster.memory)


def fill_in_order(mem: np.ndarray, order: np.ndarray, caps: np.ndarray) -> np.ndarray | None:
    """Step 3: device of every node when filling devices 0, 1, ... in `order` up to `caps`; None when
    nodes are left after the last device."""
    devices = np.empty(mem.shape[0], dtype=np.int64)
    d, used, k = 0, 0.0, caps.shape[0]
    for v in order.tolist():
        m = float(mem[v])
        while used + m > caps[d]:
            d, used = d + 1, 0.0
            if d == k:
                return None
        devices[v] = d
        used += m
    return devices


@register("m-topo", uses_order=True, cheap=True)
def m_topo(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int) -> np.ndarray:
    """Baechi's m-TOPO: fill devices in index order along the traversal order, each up to
    total op memory / k + the largest op (at most its capacity); simulated, caps lowered if over memory.

    Uses the traversal order. No settings.
    """
    mem = op_memory(graph)
    caps = baechi_caps(graph, cluster)
    model = DevplaceModel(graph, cluster)
    for _ in range(RETRIES + 1):
        devices = fill_in_order(mem, order, caps)
        if devices is None:
            raise no_fit_error(graph, cluster, "m-topo", "ops remain after the last device is filled to its cap "
                               "(caps: total op memory / devices + the largest op, at most the capacity)")
        result = model.run(devices)
        if result.feasible:
            return devices
        used = np.bincount(devices, weights=mem, minlength=cluster.num_devices)
        for d, over in result.oom.items():
            caps[d] = used[d] - over
    raise no_fit_error(graph, cluster, "m-topo", f"after {RETRIES} cap reductions the placement is still over "
                       f"memory on {describe_oom(result)}")
