"""`even`: a baseline, the module sequence cut into equal-compute contiguous parts, one per device.

What a user does by hand, and what accelerate's `device_map="balanced"` does: walk the model's modules in
program order and give each device a contiguous run of about 1/k of the work (accelerate balances parameter
memory; this balances compute, which is what the step time depends on). It is the baseline the optimising
placers must beat, not an optimiser: it ignores communication, device speed and parallel branches.

The sequence. On a captured graph (or a coarsening of one) it is the forward ops in program order, each
carrying the compute of everything autograd runs with it (its backward and optimizer ops, its input: its tie
class, `devplace.graph.ties`); cuts fall only where a module call begins (`graph.modules.module_starts`), so
every part is a run of whole module calls, as in a device_map. A graph without module information (a
hand-written JSON graph, the generated families) falls back to the canonical topological order, every
position a possible cut.

The cut. With prefix sums P of the sequence's compute and total T, cut j (j = 1..k-1) is the allowed
position whose P is nearest j*T/k (ties: the earlier one), never before cut j-1; part j runs on device j.
Memory is checked with the `devplace` simulator: when the even split is over memory, NoFitError says where
(a baseline that does not fit is reported as such, not repaired). Does not use `order`. No settings.
"""

from __future__ import annotations

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.graph.modules import forward_ops, has_modules, module_of, module_starts
from devplace.graph.ties import tie_classes
from devplace.hardware.cluster import Cluster
from devplace.placers.common import describe_oom
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import register
from devplace.sim.devplace_model import DevplaceModel


def _sequence(graph: CompGraph, classes: np.ndarray) -> tuple[list[int], list[bool]]:
    """Tie classes in program order, and per class whether a part may begin at it."""
    if has_modules(graph):
        fwd = forward_ops(graph)
        seen: set[int] = set()
        seq: list[int] = []
        labels: list[str] = []
        for v in fwd:
            c = int(classes[v])
            if c not in seen:
                seen.add(c)
                seq.append(c)
                labels.append(module_of(graph, v) or "")
        starts = module_starts(labels)
        allowed = [i in starts for i in range(len(seq))]
        # classes with no forward op (a stray backward or optimizer op): after the program, in topological order
        for v in graph.topo_order.tolist():
            c = int(classes[v])
            if c not in seen:
                seen.add(c)
                seq.append(c)
                allowed.append(False)
        return seq, allowed
    seq = []
    seen = set()
    for v in graph.topo_order.tolist():
        c = int(classes[v])
        if c not in seen:
            seen.add(c)
            seq.append(c)
    return seq, [True] * len(seq)


def even_cuts(work: np.ndarray, allowed: list[bool], parts: int) -> list[int]:
    """Start positions of parts 1..parts-1 in a sequence with per-item `work`: for each j, the allowed position
    whose prefix sum is nearest j/parts of the total (never before the previous cut)."""
    prefix = np.concatenate([[0.0], np.cumsum(work, dtype=np.float64)])
    total = float(prefix[-1])
    positions = [i for i, ok in enumerate(allowed) if ok and i > 0]
    cuts: list[int] = []
    lo = 0  # index into positions: cuts are non-decreasing
    for j in range(1, parts):
        if not positions:
            break
        target = total * j / parts
        best = None
        for k in range(lo, len(positions)):
            gap = abs(float(prefix[positions[k]]) - target)
            if best is None or gap < best[0]:
                best = (gap, k)
            elif float(prefix[positions[k]]) > target:
                break  # prefix sums only grow from here
        assert best is not None
        cuts.append(positions[best[1]])
        lo = best[1]
    return cuts


def even_split(graph: CompGraph, devices: int) -> np.ndarray:
    """The even split's device per node (module docstring), unchecked for memory: also the equal-compute
    split a pipeline is compared with under its schedule (`devplace demo`, benchmarks/pipeline.py)."""
    classes = tie_classes(graph)
    seq, allowed = _sequence(graph, classes)
    work = np.bincount(classes, weights=graph.compute_s, minlength=len(seq))[seq]
    cuts = even_cuts(work, allowed, devices)
    part_of_class = np.zeros(len(seq), dtype=np.int64)
    for j, c in enumerate(cuts, start=1):
        part_of_class[np.asarray(seq[c:], dtype=np.int64)] = j
    return part_of_class[classes]


@register("even", uses_order=False)
def even(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int) -> np.ndarray:
    """Baseline: the module sequence cut into equal-compute contiguous parts, part i on device i.

    As accelerate's `balanced` device_map (by compute, not parameter memory); cuts only where a module call
    begins; graphs without module info are cut along the topological order. Does not use the traversal
    order. Memory-checked: raises NoFitError when the even split does not fit. No settings.
    """
    devices = even_split(graph, cluster.num_devices)
    result = DevplaceModel(graph, cluster).run(devices)
    if not result.feasible:
        raise no_fit_error(graph, cluster, "even", f"the even split is over memory ({describe_oom(result)})")
    return devices
