"""Which part of a node's compute runs once per micro-batch and which once per step.

Under a micro-batch schedule, forward and backward ops (kinds "forward", "backward", or no kind) run once per
micro-batch; ops of every other kind (the optimizer's updates) once per step. A node that merges ops of both
(a coarse group or a folded tie class holding a layer's backward ops and its optimizer update) says how many
of its seconds run once per step under `STEP_COMPUTE_KEY` (at `compute_s`'s reference) and, where the graph is
costed per device kind, `STEP_COMPUTE_BY_KIND_KEY` (kind -> seconds); the rest of its compute runs per
micro-batch. Without that, the optimizer's time would be counted once per micro-batch: M times per step.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from devplace.errors import GraphError
from devplace.graph.compgraph import CompGraph

MICROBATCH_KINDS = ("", "forward", "backward")  # kinds whose ops run once per micro-batch
STEP_COMPUTE_KEY = "step_compute_s"
STEP_COMPUTE_BY_KIND_KEY = "step_compute_s_by_kind"


def runs_per_step(kind: str) -> bool:
    """True for an op kind that runs once per step under a micro-batch schedule (not forward or backward)."""
    return kind not in MICROBATCH_KINDS


class StepCompute(NamedTuple):
    """Per node, the seconds of its compute that run once per step: at `compute_s`'s reference (`compute_s`)
    and per device kind of `CompGraph.kind_compute` (`by_kind`). A node of a per-step kind: all of it."""

    compute_s: np.ndarray
    by_kind: dict[str, np.ndarray]


def step_compute(graph: CompGraph) -> StepCompute:
    """The once-per-step seconds of every node (module docstring), computed once per graph (read-only arrays).
    A GraphError names a node whose `STEP_COMPUTE_KEY` is not a number from 0 to its compute_s."""
    cols = graph.derived("step_compute_s", _step_column)
    kinds = {kind: graph.derived(f"step_compute_s:{kind}", lambda g, kind=kind: _step_column(g, kind))
             for kind in graph.kind_compute}
    return StepCompute(cols, kinds)


def step_compute_extended(graph: CompGraph, base: CompGraph) -> None:
    """Store `graph`'s once-per-step seconds as `base`'s followed by zeros, without reading `graph`'s nodes: for a
    graph that is `base` with nodes appended that run nothing once per step (forward or backward kind, no
    `STEP_COMPUTE_KEY`: the relay nodes of a pipelined step, `devplace.sim.schedule.relay`, built on every
    simulation of a split). The values are those `step_compute(graph)` computes."""
    step = step_compute(base)
    zeros = np.zeros(graph.num_nodes - base.num_nodes)
    graph.derived("step_compute_s", lambda _: np.concatenate([step.compute_s, zeros]))
    for kind, col in step.by_kind.items():
        graph.derived(f"step_compute_s:{kind}", lambda _, col=col: np.concatenate([col, zeros]))


def _step_column(graph: CompGraph, kind: str | None = None) -> np.ndarray:
    total = graph.compute_s if kind is None else graph.kind_compute[kind]
    out = np.where([runs_per_step(k) for k in graph.kind], total, 0.0) if graph.num_nodes else np.zeros(0)
    for v, extra in enumerate(graph.node_extra):
        if STEP_COMPUTE_KEY not in extra or runs_per_step(graph.kind[v]):
            continue
        ref = _seconds(graph, v, extra[STEP_COMPUTE_KEY], float(graph.compute_s[v]), STEP_COMPUTE_KEY)
        if kind is None:
            out[v] = ref
            continue
        per_kind = extra.get(STEP_COMPUTE_BY_KIND_KEY)
        if isinstance(per_kind, dict) and kind in per_kind:
            out[v] = _seconds(graph, v, per_kind[kind], float(total[v]), f"{STEP_COMPUTE_BY_KIND_KEY}.{kind}")
        else:  # no time for this kind: the same share of the node's time on it
            out[v] = total[v] * (ref / graph.compute_s[v]) if graph.compute_s[v] > 0 else 0.0
    return out


def _seconds(graph: CompGraph, v: int, value: Any, limit: float, key: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not 0 <= value <= limit * (1 + 1e-9):
        raise GraphError(f"graph {graph.name!r}: node {graph.ids[v]!r} has {key}={value!r}; it must be a number "
                         f"from 0 to the node's compute ({limit!r} s): the part of its compute that runs once per "
                         "step")
    return min(float(value), limit)


def merged_step_compute(graph: CompGraph, group: np.ndarray, count: int) -> StepCompute:
    """The once-per-step seconds of `count` merged nodes, node v of `graph` merged into group[v]: the sums."""
    step = step_compute(graph)
    return StepCompute(np.bincount(group, weights=step.compute_s, minlength=count),
                       {kind: np.bincount(group, weights=col, minlength=count) for kind, col in step.by_kind.items()})


def step_record(step: StepCompute, g: int, kind: str) -> dict[str, Any]:
    """The node-record keys of merged node g of kind `kind` that say which of its seconds run once per step
    (none when it has none, or when its kind runs once per step anyway)."""
    if runs_per_step(kind) or step.compute_s[g] <= 0:
        return {}
    rec: dict[str, Any] = {STEP_COMPUTE_KEY: float(step.compute_s[g])}
    if step.by_kind:
        rec[STEP_COMPUTE_BY_KIND_KEY] = {kind_name: float(col[g]) for kind_name, col in step.by_kind.items()}
    return rec
