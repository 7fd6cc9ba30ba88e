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
from collections.abc import Callable, Sequence
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


def per_kind(kinds: Sequence[str], value: Callable[[str], Any], dtype: Any) -> np.ndarray:
    """`value(kind)` per node of the kind column `kinds`, as an array of `dtype`: `value` runs once per distinct
    kind (a graph has a handful), not once per node (every simulation of a pipelined step reads the kinds of
    10^4-10^5 unrolled nodes)."""
    table = {k: value(k) for k in set(kinds)}
    return np.fromiter(map(table.__getitem__, kinds), dtype=dtype, count=len(kinds))


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
    """Store `graph`'s once-per-step seconds from `base`'s, without reading `graph`'s node records: for a graph
    that is `base` (same compute columns and records) with nodes appended that carry no `STEP_COMPUTE_KEY`, and
    where some of `base`'s nodes may have taken a kind that runs once per step (none the other way): the relay
    nodes of a pipelined step (`devplace.sim.schedule.relay`, forward or backward: nothing once per step) and a
    tied parameter's gradient sums and copies (`tied_copies`: all of their compute), built on every simulation
    of a split. The values are those `step_compute(graph)` computes: a node of a per-step kind runs all of its
    compute once per step, any other node what it ran in `base` (an appended one: nothing)."""
    step = step_compute(base)
    per_step = per_kind(graph.kind, runs_per_step, bool)
    zeros = np.zeros(graph.num_nodes - base.num_nodes)
    graph.derived("step_compute_s", lambda _: np.where(per_step, graph.compute_s,
                                                       np.concatenate([step.compute_s, zeros])))
    for kind, col in step.by_kind.items():
        graph.derived(f"step_compute_s:{kind}", lambda _, kind=kind, col=col: np.where(
            per_step, graph.kind_compute[kind], np.concatenate([col, zeros])))


def _step_column(graph: CompGraph, kind: str | None = None) -> np.ndarray:
    total = graph.compute_s if kind is None else graph.kind_compute[kind]
    per_step = per_kind(graph.kind, runs_per_step, bool)
    out = np.where(per_step, total, 0.0)
    extra = graph.node_extra
    marked = np.asarray([v for v, x in enumerate(extra) if STEP_COMPUTE_KEY in x], dtype=np.int64)
    marked = marked[~per_step[marked]]  # a node of a per-step kind runs all of it once per step anyway
    if not marked.size:
        return out
    ref = _seconds(graph, marked, [extra[v][STEP_COMPUTE_KEY] for v in marked.tolist()], graph.compute_s[marked],
                   STEP_COMPUTE_KEY)
    if kind is None:
        out[marked] = ref
        return out
    # no time for this kind: the same share of the node's time on it
    cs = graph.compute_s[marked]
    out[marked] = np.where(cs > 0, total[marked] * (ref / np.where(cs > 0, cs, 1.0)), 0.0)
    given = [extra[v].get(STEP_COMPUTE_BY_KIND_KEY) for v in marked.tolist()]
    has = [i for i, d in enumerate(given) if isinstance(d, dict) and kind in d]
    if has:
        sel = marked[has]
        out[sel] = _seconds(graph, sel, [given[i][kind] for i in has], total[sel], f"{STEP_COMPUTE_BY_KIND_KEY}.{kind}")
    return out


def _seconds(graph: CompGraph, nodes: np.ndarray, values: list[Any], limits: np.ndarray, key: str) -> np.ndarray:
    """The once-per-step seconds `values` of `nodes` (each a number from 0 to its node's `limits`, a hair of
    rounding above allowed and cut off), or a GraphError naming the first node whose value is not. Checked as
    one array where every value is a plain int or float (a graph has 10^3-10^4 such nodes); else, or where that
    check fails, node by node (the rule as written, and the message)."""
    if set(map(type, values)) <= {int, float}:
        try:
            arr = np.array(values, dtype=np.float64)
        except OverflowError:  # an integer too large for a float: named below
            arr = None
        if arr is not None and (np.isfinite(arr) & (arr >= 0) & (arr <= limits * (1 + 1e-9))).all():
            return np.minimum(arr, limits)
    out = np.empty(len(values))
    for i, (v, value, limit) in enumerate(zip(nodes.tolist(), values, limits.tolist(), strict=True)):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not 0 <= value <= limit * (1 + 1e-9):
            raise GraphError(f"graph {graph.name!r}: node {graph.ids[v]!r} has {key}={value!r}; it must be a number "
                             f"from 0 to the node's compute ({limit!r} s): the part of its compute that runs once "
                             "per step")
        out[i] = min(float(value), limit)
    return out


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
