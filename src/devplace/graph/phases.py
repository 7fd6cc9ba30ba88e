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


# --------------------------------------------------------------------------- gradient accumulation
# Under a micro-batch schedule each micro-batch's backward adds its parameter gradients into `.grad`: the first
# micro-batch's gradient becomes `.grad` (autograd's AccumulateGrad steals it; torch's split backward assigns it),
# every later one is added in place (`.grad += g`), right after the op that produced it. A node that produces
# parameter gradients says what those adds cost (`ACCUMULATE_KEY`, at `compute_s`'s reference, and per device
# kind `ACCUMULATE_BY_KIND_KEY`: written by the cost model from `ACCUMULATES_KEY`, the adds' signatures a capture
# records) and the gradients' bytes (`ACCUMULATE_BYTES_KEY`: the new gradient, held while it is added). A coarse
# group or folded class sums its members'.
ACCUMULATES_KEY = "accumulates"  # list of {"sig": the add's signature, "bytes": the gradient's bytes}
ACCUMULATE_KEY = "accumulate_s"
ACCUMULATE_BY_KIND_KEY = "accumulate_s_by_kind"
ACCUMULATE_BYTES_KEY = "accumulate_bytes"


class Accumulation(NamedTuple):
    """Per node, what adding its gradients into `.grad` costs on a micro-batch after the first: seconds at
    `compute_s`'s reference (`compute_s`) and per device kind of `CompGraph.kind_compute` (`by_kind`), and the
    bytes of the gradients added (`nbytes`). 0 for a node that produces no parameter gradient."""

    compute_s: np.ndarray
    by_kind: dict[str, np.ndarray]
    nbytes: np.ndarray


def accumulation(graph: CompGraph) -> Accumulation:
    """The gradient accumulation of every node (the section above), read from its record's keys once per graph
    (read-only arrays). A GraphError names a node whose value is not a finite number >= 0. A per-kind time the
    node does not give is its reference time scaled as its compute is on that kind."""
    return Accumulation(_ref(graph), {kind: graph.derived(f"{ACCUMULATE_KEY}:{kind}",
                                                          lambda g, kind=kind: _kind_column(g, kind))
                                      for kind in graph.kind_compute},
                        graph.derived(ACCUMULATE_BYTES_KEY, lambda g: _accumulate_column(g, ACCUMULATE_BYTES_KEY)))


def _ref(graph: CompGraph) -> np.ndarray:
    return graph.derived(ACCUMULATE_KEY, lambda g: _accumulate_column(g, ACCUMULATE_KEY))


def _accumulate_column(graph: CompGraph, key: str) -> np.ndarray:
    out = np.zeros(graph.num_nodes)
    for v, extra in enumerate(graph.node_extra):
        if key in extra:
            out[v] = _number_at(graph, v, key, extra[key])
    return out


def _kind_column(graph: CompGraph, kind: str) -> np.ndarray:
    ref = _ref(graph)
    cs, total = graph.compute_s, graph.kind_compute[kind]
    out = np.where(cs > 0, ref * (total / np.where(cs > 0, cs, 1.0)), ref)
    for v in np.flatnonzero(ref > 0).tolist():
        given = graph.node_extra[v].get(ACCUMULATE_BY_KIND_KEY)
        if isinstance(given, dict) and kind in given:
            out[v] = _number_at(graph, v, f"{ACCUMULATE_BY_KIND_KEY}.{kind}", given[kind])
    return out


def _number_at(graph: CompGraph, v: int, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise GraphError(f"graph {graph.name!r}: node {graph.ids[v]!r} has {key}={value!r}; it must be a finite "
                         "number >= 0 (what adding the node's parameter gradients into .grad costs on a "
                         "micro-batch after the first)")
    return float(value)


def merged_accumulation(graph: CompGraph, group: np.ndarray, count: int) -> Accumulation:
    """The gradient accumulation of `count` merged nodes, node v of `graph` merged into group[v]: the sums."""
    acc = accumulation(graph)
    return Accumulation(np.bincount(group, weights=acc.compute_s, minlength=count),
                        {kind: np.bincount(group, weights=col, minlength=count) for kind, col in acc.by_kind.items()},
                        np.bincount(group, weights=acc.nbytes, minlength=count))


def accumulation_record(acc: Accumulation, g: int) -> dict[str, Any]:
    """The node-record keys of merged node g that say what its gradient accumulation costs (none without one)."""
    if acc.compute_s[g] <= 0 and acc.nbytes[g] <= 0:
        return {}
    rec: dict[str, Any] = {ACCUMULATE_KEY: float(acc.compute_s[g]), ACCUMULATE_BYTES_KEY: float(acc.nbytes[g])}
    if acc.by_kind:
        rec[ACCUMULATE_BY_KIND_KEY] = {kind: float(col[g]) for kind, col in acc.by_kind.items()}
    return rec


def accumulation_extended(graph: CompGraph, base: CompGraph, moved: Accumulation | None = None) -> None:
    """Store `graph`'s gradient accumulation without reading its node records: `base`'s for `base`'s nodes and 0
    for the nodes appended after them (relays, tied copies, recomputed ops), as `step_compute_extended` does for
    the once-per-step seconds; or `moved`, computed by the caller for every node (a tied parameter's sum whose
    adds the contributing stages make, `devplace.sim.schedule.tied_copies`)."""
    if moved is None:
        acc = accumulation(base)
        zeros = np.zeros(graph.num_nodes - base.num_nodes)
        moved = Accumulation(np.concatenate([acc.compute_s, zeros]),
                             {kind: np.concatenate([col, zeros]) for kind, col in acc.by_kind.items()},
                             np.concatenate([acc.nbytes, zeros]))
    graph.derived(ACCUMULATE_KEY, lambda _: moved.compute_s)
    graph.derived(ACCUMULATE_BYTES_KEY, lambda _: moved.nbytes)
    for kind, col in moved.by_kind.items():
        graph.derived(f"{ACCUMULATE_KEY}:{kind}", lambda _, col=col: col)
