"""Memory as a hard constraint: what a graph needs, and the error a placer raises when nothing fits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.sim.devplace_model import DevplaceModel
from devplace.units import fmt_bytes


class NoFitError(DevplaceError):
    """No memory-feasible placement was found: the message gives the memory needed and available; `reason`
    the placer's own words (what a message that wraps this one quotes). `memory` False: nothing was judged on
    memory, the placements the placer could make are all ones that do not run (`unrunnable_error`), so a search
    that wraps it must not say "no fit"."""

    reason: str = ""
    memory: bool = True


def unrunnable_error(message: str, reason: str) -> NoFitError:
    """The NoFitError for "no placement of this kind runs" (not memory): `message` the whole error, `reason`
    the placer's own words for a wrapping message."""
    err = NoFitError(message)
    err.reason, err.memory = reason, False
    return err


@dataclass(frozen=True)
class MemoryNeeds:
    """`params_bytes`: every op's persistent memory; `activations_bytes`: the peak of the live memory
    (outputs, temporaries) when the whole step runs on one device; `largest_op_bytes`: the most one op
    holds at once (its params + output + temp), which the largest device must hold."""

    params_bytes: float
    activations_bytes: float
    largest_op_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.activations_bytes


def memory_needs(graph: CompGraph) -> MemoryNeeds:
    """Memory the step needs on one device of unlimited memory (the live peak of that schedule)."""
    one = Cluster("one", (Device("one", float("inf")),), Link(1.0))
    result = DevplaceModel(graph, one).run(np.zeros(graph.num_nodes, dtype=np.int64))
    params = float(graph.param_bytes.sum())
    own = graph.param_bytes + graph.output_bytes + graph.temp_bytes
    return MemoryNeeds(params_bytes=params, activations_bytes=float(result.peak_memory_bytes[0]) - params,
                       largest_op_bytes=float(own.max()) if graph.num_nodes else 0.0)


def no_fit_error(graph: CompGraph, cluster: Cluster, placer: str, why: str = "") -> NoFitError:
    """The error for "nothing fits": memory needed vs available, and the smallest preset or device count
    that would hold the step."""
    from devplace.hardware.presets import PRESETS

    needs = memory_needs(graph)
    have = float(cluster.memory.sum())
    largest = float(cluster.memory.max())
    msg = (f"placer {placer!r} found no placement of {graph.name!r} that fits {cluster.name!r}"
           f"{': ' + why if why else ''}. The step needs about {fmt_bytes(needs.total_bytes)} "
           f"(parameters and optimizer state {fmt_bytes(needs.params_bytes)} + peak activations "
           f"{fmt_bytes(needs.activations_bytes)} on one device); the cluster has {fmt_bytes(have)} in "
           f"{cluster.num_devices} devices (largest {fmt_bytes(largest)}).")
    fits = []  # presets with more memory than this cluster that hold the step with 20% headroom
    for name, factory in PRESETS.items():
        c = factory()
        total = float(c.memory.sum())
        if (name != cluster.name and total > have and total >= 1.2 * needs.total_bytes
                and float(c.memory.max()) >= needs.largest_op_bytes):
            fits.append((total, c.num_devices, name))
    if needs.largest_op_bytes > largest:
        msg += f" One op alone holds {fmt_bytes(needs.largest_op_bytes)}, more than the largest device."
    elif have >= 1.2 * needs.total_bytes:
        msg += (" The cluster holds that in total: another placer (e.g. m-etf or m-sct) or another traversal"
                " order may find a placement that fits.")
    else:
        # the same devices, enough of them to hold the step with 20% headroom for transfers
        count = max(cluster.num_devices + 1, math.ceil(1.2 * needs.total_bytes / float(cluster.memory.min())))
        msg += f" Try {count} devices like {cluster.devices[0].name}"
        msg += f", or the preset {min(fits)[2]!r}." if fits else "."
    if needs.largest_op_bytes > largest and fits:
        msg += f" The smallest preset that would hold it: {min(fits)[2]!r}."
    err = NoFitError(msg)
    err.reason = why
    return err
