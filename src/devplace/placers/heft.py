"""`heft`: HEFT (Topcuoglu, Hariri, Wu, IEEE TPDS 2002), memory-aware.

Does not use `order`: HEFT's own priority, the upward rank, decides the order in which ops are placed
(the `critical-path` traversal order is that same ranking, offered to the sequential placers).

What it does, exactly (the shared core is `devplace.placers.list_scheduling`):

1. Upward rank = `devplace.orders.bottom_levels(graph, cluster)`: the op's compute time at the mean
   over devices plus the longest path to a sink of mean compute and mean communication (mean latency +
   bytes x mean inverse bandwidth over ordered device pairs). Ops are placed by decreasing rank, ties by
   topological rank (a topological order).
2. Each op goes to the device where it finishes earliest, ties to the lowest device index. Its start there
   is the earliest time >= its data-ready time (inputs on the same device at their producer's finish,
   others after a transfer on the pair's FIFO channel, channel contention included) at which the device
   is idle for the op's whole duration: with `insertion=True` (HEFT's insertion policy, the default) an
   idle gap between ops already scheduled counts, with `insertion=False` only the time after the device's
   last op.
3. Memory-aware: a device whose free memory (Baechi's accounting: params held for good, outputs until all
   their consumers are placed, received inputs) cannot hold the op's params + temp + output + inputs it
   would receive is skipped. The placement is simulated; a device that is over memory gets a lower cap and
   the schedule is redone (at most 8 times); nothing that fits: NoFitError.

Deviation from the paper: its costs are per (task, processor) from a table; here an op's time on a device
is `compute_s / speed`, and communication is per link of the cluster rather than one average.
Cost: O(V x D x in-degree + insertions), compiled; well under a second for 10k ops.
"""

from __future__ import annotations

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.orders import bottom_levels
from devplace.placers.list_scheduling import ListScheduler, place_within_memory
from devplace.placers.registry import register


def heft_priority(graph: CompGraph, cluster: Cluster) -> np.ndarray:
    """Node indices by decreasing upward rank, ties by topological rank."""
    rank_u = bottom_levels(graph, cluster)
    return np.lexsort((graph.topo_rank, -rank_u)).astype(np.int64)


@register("heft", uses_order=False)
def heft(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int, insertion: bool = True,
         ties: np.ndarray | None = None) -> np.ndarray:
    """HEFT: ops by decreasing upward rank, each to the device where it finishes earliest (memory-aware).

    Does not use `order`: HEFT's upward rank is its own priority. `insertion` lets an op fill an idle gap
    between ops already on a device (the paper's policy). Deterministic; `seed` is unused. `ties` (given by
    `place` under the autograd rule): the first op of a tie class placed decides the device of the whole class.
    """
    sched = ListScheduler(graph, cluster, ties)
    prio = heft_priority(graph, cluster)
    return place_within_memory(graph, cluster, "heft",
                               lambda caps: sched.heft(prio, insertion=bool(insertion), cap=caps))
