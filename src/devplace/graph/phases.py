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
# records) and the gradients' bytes (`ACCUMULATE_BYTES_KEY`: the new gradient, held while it is added). With a
# loss that is a mean over the batch (meta capture.loss_reduction "mean"), torch's pipelining also divides every
# gradient by M once per step, after the stage's last backward (`stage.scale_grads`): `SCALE_KEY`,
# `SCALE_BY_KIND_KEY`, costed from the same entries' "scale_sig" (a `div_` by `SCALE_BY`, as the in-step profile
# runs it: its time does not hang on the divisor). A coarse group or folded class sums its members'.
ACCUMULATES_KEY = "accumulates"  # list of {"sig": the add, "scale_sig": the division, "bytes": the gradient's bytes}
ACCUMULATE_KEY = "accumulate_s"
ACCUMULATE_BY_KIND_KEY = "accumulate_s_by_kind"
ACCUMULATE_BYTES_KEY = "accumulate_bytes"
SCALE_KEY = "scale_s"
SCALE_BY_KIND_KEY = "scale_s_by_kind"
SCALE_BY = 2  # the divisor of a recorded division's signature
_TIMES = ((ACCUMULATE_KEY, ACCUMULATE_BY_KIND_KEY), (SCALE_KEY, SCALE_BY_KIND_KEY))


class Accumulation(NamedTuple):
    """Per node, what its parameter gradients cost besides its compute under micro-batches: adding them into
    `.grad` on a micro-batch after the first (seconds at `compute_s`'s reference, `compute_s`, and per device kind
    of `CompGraph.kind_compute`, `by_kind`; the bytes added, `nbytes`), and dividing them by M once per step where
    the loss is a mean (`scale_s`, `scale_by_kind`). 0 for a node that produces no parameter gradient."""

    compute_s: np.ndarray
    by_kind: dict[str, np.ndarray]
    nbytes: np.ndarray
    scale_s: np.ndarray
    scale_by_kind: dict[str, np.ndarray]

    def columns(self) -> list[np.ndarray]:
        """Every column, per kind ones included (what a merge sums and a tied sum moves)."""
        return [self.compute_s, *self.by_kind.values(), self.nbytes, self.scale_s, *self.scale_by_kind.values()]

    def like(self, cols: list[np.ndarray]) -> Accumulation:
        """An Accumulation of the same kinds from `columns()`-ordered `cols`."""
        k = len(self.by_kind)
        kinds, scale_kinds = list(self.by_kind), list(self.scale_by_kind)
        return Accumulation(cols[0], dict(zip(kinds, cols[1:1 + k], strict=True)), cols[1 + k], cols[2 + k],
                            dict(zip(scale_kinds, cols[3 + k:], strict=True)))


def accumulation(graph: CompGraph) -> Accumulation:
    """The gradient accumulation and scaling of every node (the section above), read from its record's keys once
    per graph (read-only arrays). A GraphError names a node whose value is not a finite number >= 0. A per-kind
    time the node does not give is its reference time scaled as its compute is on that kind."""
    (ref, by_kind), (scale, scale_by_kind) = ((_column(graph, key), {
        kind: graph.derived(f"{key}:{kind}", lambda g, kind=kind, key=key, kinds=kinds: _kind_column(g, kind, key,
                                                                                                  kinds))
        for kind in graph.kind_compute}) for key, kinds in _TIMES)
    return Accumulation(ref, by_kind, _column(graph, ACCUMULATE_BYTES_KEY), scale, scale_by_kind)


def scales_gradients(graph: CompGraph) -> bool:
    """Whether torch's pipelining divides this graph's gradients by M once per step: its capture's loss is a mean."""
    captured = graph.meta.get("capture")
    return isinstance(captured, dict) and captured.get("loss_reduction") == "mean"


def _column(graph: CompGraph, key: str) -> np.ndarray:
    def read(g: CompGraph) -> np.ndarray:
        out = np.zeros(g.num_nodes)
        for v, extra in enumerate(g.node_extra):
            if key in extra:
                out[v] = _number_at(g, v, key, extra[key])
        return out
    return graph.derived(key, read)


def _kind_column(graph: CompGraph, kind: str, key: str, kinds_key: str) -> np.ndarray:
    ref = _column(graph, key)
    cs, total = graph.compute_s, graph.kind_compute[kind]
    out = np.where(cs > 0, ref * (total / np.where(cs > 0, cs, 1.0)), ref)
    for v in np.flatnonzero(ref > 0).tolist():
        given = graph.node_extra[v].get(kinds_key)
        if isinstance(given, dict) and kind in given:
            out[v] = _number_at(graph, v, f"{kinds_key}.{kind}", given[kind])
    return out


def _number_at(graph: CompGraph, v: int, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise GraphError(f"graph {graph.name!r}: node {graph.ids[v]!r} has {key}={value!r}; it must be a finite "
                         "number >= 0 (what adding the node's parameter gradients into .grad on a later "
                         "micro-batch, or dividing them by the micro-batch count, costs)")
    return float(value)


def merged_accumulation(graph: CompGraph, group: np.ndarray, count: int) -> Accumulation:
    """The gradient accumulation of `count` merged nodes, node v of `graph` merged into group[v]: the sums."""
    acc = accumulation(graph)
    return acc.like([np.bincount(group, weights=col, minlength=count) for col in acc.columns()])


def accumulation_record(acc: Accumulation, g: int) -> dict[str, Any]:
    """The node-record keys of merged node g that say what its gradient accumulation costs (none without one)."""
    if acc.compute_s[g] <= 0 and acc.nbytes[g] <= 0 and acc.scale_s[g] <= 0:
        return {}
    rec: dict[str, Any] = {ACCUMULATE_KEY: float(acc.compute_s[g]), ACCUMULATE_BYTES_KEY: float(acc.nbytes[g]),
                           SCALE_KEY: float(acc.scale_s[g])}
    if acc.by_kind:
        rec[ACCUMULATE_BY_KIND_KEY] = {kind: float(col[g]) for kind, col in acc.by_kind.items()}
        rec[SCALE_BY_KIND_KEY] = {kind: float(col[g]) for kind, col in acc.scale_by_kind.items()}
    return rec


def accumulation_extended(graph: CompGraph, base: CompGraph, moved: Accumulation | None = None) -> None:
    """Store `graph`'s gradient accumulation without reading its node records: `base`'s for `base`'s nodes and 0
    for the nodes appended after them (relays, tied copies, recomputed ops), as `step_compute_extended` does for
    the once-per-step seconds; or `moved`, computed by the caller for every node (a tied parameter's sum whose
    adds the contributing stages make, `devplace.sim.schedule.tied_copies`)."""
    if moved is None:
        acc = accumulation(base)
        zeros = np.zeros(graph.num_nodes - base.num_nodes)
        moved = acc.like([np.concatenate([col, zeros]) for col in acc.columns()])
    graph.derived(ACCUMULATE_KEY, lambda _: moved.compute_s)
    graph.derived(ACCUMULATE_BYTES_KEY, lambda _: moved.nbytes)
    graph.derived(SCALE_KEY, lambda _: moved.scale_s)
    for (key, _), cols in zip(_TIMES, (moved.by_kind, moved.scale_by_kind), strict=True):
        for kind, col in cols.items():
            graph.derived(f"{key}:{kind}", lambda _, col=col: col)
