"""The lower bound of DESIGN.md section 8: no placement and op schedule can beat it; for a pipelined step
(a micro-batch `Schedule`) the bound of the step that schedule runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import linprog
from scipy.sparse.csgraph import breadth_first_order

from devplace.graph.compgraph import CompGraph
from devplace.graph.info import longest_path
from devplace.graph.phases import per_kind
from devplace.graph.tensors import sorted_within
from devplace.hardware.cluster import Cluster, op_times, step_times
from devplace.sim.schedule import Schedule, tied_sums
from devplace.units import fmt_bytes


@dataclass(frozen=True)
class LowerBound:
    """`value_s` = max(`work_s`, `critical_path_s`); `critical_path` lists the node indices of one longest path."""

    value_s: float
    work_s: float  # total compute / total speed (or the kinds' shared work): every device busy all the time
    critical_path_s: float  # longest path with every op on its fastest device, no communication
    critical_path: tuple[int, ...]

    @property
    def limited_by(self) -> str:
        return "critical path" if self.critical_path_s >= self.work_s else "total work"


def lower_bound(graph: CompGraph, cluster: Cluster, schedule: Schedule | None = None) -> LowerBound:
    """LB = max(work bound, critical path at each op's fastest device without communication).

    The work bound is sum compute / sum speeds where every device takes compute_s / speed; where the graph was
    costed per device kind (`graph.kind_compute`, ops faster on one kind than its speed says), it is the least
    time in which the devices could share the work if any op could be split between them (a linear program:
    every op's fractions sum to 1, each kind's devices finish their share by then).

    Without `schedule`, valid for every placement of the step run as one batch (no micro-batches). With a
    micro-batch `schedule`, the bound of the step that schedule runs (docs/simulation.md, "Pipeline
    schedules"): forward and backward ops run M times at 1/M of their compute (at all of it for a
    `microbatch_graph`, captured at batch/M), per-step ops once. The work is the unrolled step's; the critical
    path is one micro-batch's ops followed by per-step ops, which the unrolled step holds for its last
    micro-batch. A tied parameter's gradient sum runs once per step where its inputs come from two stages
    (`sim.schedule.tied_sums`), else once per micro-batch: its work counts once. `any_schedule_bound` holds for
    every schedule at once."""
    times = op_times(graph, cluster)  # [V, D]
    work_times = times
    if schedule is not None:
        once = step_times(graph, cluster)  # per-step ops, and the per-step part of merged nodes
        m = schedule.microbatches
        if schedule.microbatch_graph:
            work_times = (times - once) * m + once
            sums = tied_sums(graph)[0]
            work_times[sums] = times[sums]
        else:
            times = (times - once) / m + once  # M runs at 1/M: the same work, a shorter path
    return _bound(graph, cluster, work_times, times)


def any_schedule_bound(graph: CompGraph, cluster: Cluster) -> LowerBound:
    """A bound valid for every placement of `graph`'s step run unpipelined or under any micro-batch schedule
    (any kind, any M) that splits the whole batch's forward and backward compute into equal micro-batches: the
    work is the same whatever M, and the critical path keeps only the per-step ops (optimizer updates), the
    limit of one micro-batch's path as M grows. Not above `lower_bound(graph, cluster, schedule)` for any such
    schedule, nor above `lower_bound(graph, cluster)`."""
    return _bound(graph, cluster, op_times(graph, cluster), step_times(graph, cluster))


def microbatch_bounds(graph: CompGraph, cluster: Cluster, counts: Sequence[int], *,
                      one_stage_per_device: bool) -> dict[int, float]:
    """Per micro-batch count M of `counts`, a lower bound on the step of any pipeline of `graph`'s step
    (captured at the whole batch, so `graph_microbatches(graph)` is 1) split into M micro-batches, each captured
    at batch / M, assuming each op takes at least 1/M of its whole-batch time on a micro-batch (its flops scale
    with the batch, its bytes at most do, its fixed costs stay): what the micro-batch search may skip a count by
    before capturing it.

    Any schedule: the fastest the devices share the forward, backward and per-step work (`work_s`). With one
    stage per device (gpipe, 1f1b) also the bubble: the device of stage k runs M t_k (t_k: its stage's forward +
    backward per micro-batch) after the first micro-batch's forwards through stages 0..k-1 and before the last
    one's backwards through them, so step >= M t_k + sum_{j<k} t_j for every k; over every split with sum_k t_k =
    S that is least when t_k = t_0 r^k (r = (M - 1) / M), where it is S / (1 - r^p) (p stages at most, one per
    device), and S is at least one micro-batch's forward and backward with each op on its fastest device."""
    times = op_times(graph, cluster)
    once = step_times(graph, cluster)
    # a tied gradient's sum may run once per step at a micro-batch's size (`tied_sums`): at least 1/M of its
    # time, off every micro-batch's chain
    sums = tied_sums(graph)[0]
    shared = times.copy()
    shared[sums] /= max(counts, default=1)
    work = _work_bound(graph, cluster, shared)  # the same for every M
    chain = float((times - once)[~sums].min(axis=1).sum()) if times.size else 0.0  # S for M = 1
    p = cluster.num_devices
    out = {}
    for m in counts:
        bound = max(work, chain / m / (1.0 - ((m - 1) / m) ** p)) if one_stage_per_device else work
        out[m] = bound * (1 - 1e-9)  # float rounding must not lift the bound above a real step
    return out


@dataclass(frozen=True)
class MicrobatchOutlook:
    """What a micro-batch count's own graph (captured at batch / M) says before a pipeline of it is placed:
    `bound_s`, below the step of every pipeline of it (`microbatch_bounds`' rules on the ops' times at the
    micro-batch's own size, fixed costs included), and `estimate_s`, the step of equal stages under the
    schedule's bubble (not a bound: unequal stages on unequal devices can beat it)."""

    bound_s: float
    estimate_s: float


def microbatch_outlook(graph: CompGraph, cluster: Cluster, microbatches: int, *, chunks: int,
                       one_stage_per_device: bool) -> MicrobatchOutlook:
    """`MicrobatchOutlook` of `graph`, one of `microbatches` micro-batches of a step (captured at batch / M;
    M = 1: the whole step) pipelined with `chunks` stages per device: the work of M micro-batches and the
    per-step work shared by the devices (`work_s`), and with one stage per device the bubble of
    `microbatch_bounds` on one micro-batch's forward and backward with each op on its fastest device; the
    estimate is the work times (M V + p - 1) / (M V), V = `chunks`."""
    times = op_times(graph, cluster)
    once = step_times(graph, cluster)
    m, p = microbatches, cluster.num_devices
    sums = tied_sums(graph)[0]  # once per step where tied copies sum them (`lower_bound`)
    work_times = (times - once) * m + once
    work_times[sums] = times[sums]
    work = _work_bound(graph, cluster, work_times)
    chain = float((times - once)[~sums].min(axis=1).sum()) if times.size else 0.0
    bound = max(work, chain / (1.0 - ((m - 1) / m) ** p)) if one_stage_per_device else work
    return MicrobatchOutlook(bound * (1 - 1e-9), work * (m * chunks + p - 1) / (m * chunks))


def microbatch_work_bound(graph: CompGraph, cluster: Cluster, microbatches: int) -> float:
    """A lower bound on the step of every pipeline (any schedule, any split, any op order) of `microbatches` runs of
    `graph`'s forward and backward ops on `cluster`'s devices, `graph` being one micro-batch captured at its own
    size: the least time in which the devices could share that work (`_work_bound`). Each device runs one op at a
    time, so the step is at least its busiest device's seconds; the once-per-step work (optimizer updates, the
    once-per-step part of merged nodes, and the tied gradients' sums, `tied_sums`, which may run once per step) is
    left out, so anything added to the step (ZeRO's sharded updates, recomputation, relays, transfers) only keeps it
    below: what the parallel plans' search may skip a data-parallel degree's pipelines by (each replica runs such a
    pipeline)."""
    times = op_times(graph, cluster)
    work_times = (times - step_times(graph, cluster)) * microbatches
    work_times[tied_sums(graph)[0]] = 0.0
    return _work_bound(graph, cluster, work_times) * (1 - 1e-9)  # float rounding must not lift it above a step


def _bound(graph: CompGraph, cluster: Cluster, work_times: np.ndarray, path_times: np.ndarray) -> LowerBound:
    """max(the work bound of `work_times`, the longest path with every op at its least of `path_times`)."""
    work = _work_bound(graph, cluster, work_times)
    t = path_times.min(axis=1).tolist()
    path = longest_path(graph, t)
    cp = sum(t[v] for v in path)
    return LowerBound(value_s=max(work, cp), work_s=work, critical_path_s=cp, critical_path=tuple(path))


def _work_bound(graph: CompGraph, cluster: Cluster, work_times: np.ndarray) -> float:
    """The least time in which the devices could do `work_times` (seconds per op and device) together, every
    device busy all the time."""
    if any(d.kind in graph.kind_compute for d in cluster.devices):
        return _shared_work(work_times)
    return float(work_times[:, 0].sum() * cluster.speeds[0] / cluster.speeds.sum()) if work_times.size else 0.0


def _shared_work(times: np.ndarray) -> float:
    """min T such that fractions x[v, k] >= 0 of every op over the device kinds k (identical columns of `times`,
    n_k devices each) sum to 1 per op and sum_v x[v, k] t[v, k] <= n_k T: no placement's busiest device is
    less loaded, so no step is shorter."""
    cols, counts = np.unique(times, axis=1, return_counts=True)
    n, k = cols.shape
    if n == 0:
        return 0.0
    if k == 1:
        return float(cols[:, 0].sum() / counts[0])
    # variables: x[v, k] row-major, then T
    rows_eq = np.repeat(np.arange(n), k)
    a_eq = sparse.csr_matrix((np.ones(n * k), (rows_eq, np.arange(n * k))), shape=(n, n * k + 1))
    a_ub = sparse.hstack([sparse.csr_matrix((cols.ravel(), (np.tile(np.arange(k), n), np.arange(n * k))),
                                            shape=(k, n * k)),
                          sparse.csr_matrix(-counts.astype(np.float64).reshape(k, 1))]).tocsr()
    cost = np.zeros(n * k + 1)
    cost[-1] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(k), A_eq=a_eq, b_eq=np.ones(n), bounds=(0, None), method="highs")
    if res.status != 0:  # cannot happen for finite times; the serial bound is still valid then
        return float(cols.min(axis=1).sum() / counts.sum())
    return float(res.x[-1]) * (1 - 1e-9)  # the solver's tolerance must not lift the bound above a real step


# --------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryBound:
    """Lower bounds on the memory of `graph`'s step run unpipelined (the reference model, DESIGN.md section 4)
    under any placement (`memory_lower_bound`): `total_bytes` held at one instant summed over the devices (every
    parameter, gradient and optimizer state, and the activations live at `total_at`'s start), and
    `op_bytes` held by the device that runs `op` when it starts (its tie class's parameters, its inputs, its
    output and scratch)."""

    total_bytes: float
    params_bytes: float
    total_at: int  # node index, -1 for none
    op_bytes: float
    op: int  # node index, -1 for none

    def why_not(self, graph: CompGraph, cluster: Cluster) -> str | None:
        """Why no placement of `graph` on `cluster` fits memory (a sentence), or None when the bound allows one."""
        have, largest = float(cluster.memory.sum()), float(cluster.memory.max())
        if self.total_bytes > have:
            where = f" when {graph.ids[self.total_at]!r} starts" if self.total_at >= 0 else ""
            return (f"its lower bound on memory is {fmt_bytes(self.total_bytes)} (parameters with their gradients "
                    f"and optimizer state {fmt_bytes(self.params_bytes)} + the activations live{where}), the "
                    f"cluster has {fmt_bytes(have)}")
        if self.op_bytes > largest:
            return (f"the device that runs {graph.ids[self.op]!r} holds at least {fmt_bytes(self.op_bytes)} when it "
                    f"starts (its tie class's parameters, its inputs, output and scratch), the largest device has "
                    f"{fmt_bytes(largest)}")
        return None


def memory_lower_bound(graph: CompGraph, cluster: Cluster, classes: np.ndarray | None = None) -> MemoryBound:
    """Lower bounds on the memory any placement of `graph` on `cluster` holds, run unpipelined (`MemoryBound`),
    each class of `classes` (a class per node; None: every node its own) on one device. What the search skips a
    candidate by before running it: a placement can fit only if `why_not` is None.

    Why they hold (DESIGN.md section 4, rule 7): an op x that takes time starts at some s and ends after it.
    Its inputs are held on its device at s (produced there and not freed before x finishes, or received there
    and freed only when x finishes), so are its output and scratch, and every parameter of its tie class. And an
    output of an ancestor u of x read by x or by a descendant of x is held somewhere at s: on u's device from u's
    start until its transfers arrive, and where it is received from the transfer's start until its readers there
    finish (the bytes of the tensors read, at least). Summed over the devices, every parameter is held all the
    step. The total is taken at a few x (where the backward pass begins: the last forward ops and the first
    backward ops that take time, in the canonical order), each giving a bound."""
    times = op_times(graph, cluster).min(axis=1) if graph.num_nodes else np.zeros(0)
    runs = times > 0  # an op of no time holds nothing (a zero-length interval)
    params = float(graph.param_bytes.sum())
    own = (graph.param_bytes if classes is None or not graph.num_nodes else
           np.bincount(classes, weights=graph.param_bytes)[classes])
    op_need = np.where(runs, own + op_holds(graph), 0.0)
    op = int(np.argmax(op_need)) if graph.num_nodes else -1
    best, at = 0.0, -1
    edges = sparse.csr_matrix((np.ones(graph.num_edges), (graph.edge_src, graph.edge_dst)),
                              shape=(graph.num_nodes, graph.num_nodes))
    for x in _stash_points(graph, runs):
        live = _live_at(graph, edges, x) + graph.output_bytes[x] + graph.temp_bytes[x]
        if live > best:
            best, at = float(live), x
    return MemoryBound(params + best, params, at, float(op_need[op]) if op >= 0 else 0.0, op)


def op_holds(graph: CompGraph) -> np.ndarray:
    """Per op, the least it holds on its device when it starts (`memory_lower_bound`): its inputs (per producer,
    the bytes of the distinct tensors it reads, at most the producer's output: held there if produced there,
    else received), its output and its scratch."""
    src, dst = graph.edge_src, graph.edge_dst
    read = np.zeros(graph.num_nodes)
    if graph.num_edges:
        # the distinct tensors (dst, src, tensor), each at its first edge, in that order, and the distinct
        # (dst, src) pairs among them: the consumers' in-edges sorted by (src, tensor) and their runs
        order = sorted_within(graph.pred_ptr, graph.pred_edges, src, graph.edge_tensor)
        d, s, t = dst[order], src[order], graph.edge_tensor[order]
        new = np.ones(order.size, dtype=bool)
        new[1:] = (d[1:] != d[:-1]) | (s[1:] != s[:-1]) | (t[1:] != t[:-1])
        first, d, s = order[new], d[new], s[new]
        pair = np.ones(first.size, dtype=bool)
        pair[1:] = (d[1:] != d[:-1]) | (s[1:] != s[:-1])
        per_pair = np.bincount(np.cumsum(pair) - 1, weights=graph.edge_bytes[first])
        np.add.at(read, d[pair], np.minimum(per_pair, graph.output_bytes[s[pair]]))
    return read + graph.output_bytes + graph.temp_bytes


STASH_POINTS = 4  # the ops on either side of the start of the backward pass that the total bound is taken at


def _stash_points(graph: CompGraph, runs: np.ndarray) -> list[int]:
    """The ops `memory_lower_bound` takes the total at: the last `STASH_POINTS` forward ops and the first
    `STASH_POINTS` other ops that take time, in the canonical order (all forward: the last ones)."""
    topo = graph.topo_order
    fwd = per_kind(graph.kind, lambda k: k in ("", "forward"), bool)[topo]
    timed = runs[topo]
    last = topo[fwd & timed][-STASH_POINTS:]
    first = topo[~fwd & timed][:STASH_POINTS]
    return [int(v) for v in np.concatenate([last, first])]


def _live_at(graph: CompGraph, edges: sparse.csr_matrix, x: int) -> float:
    """Bytes held somewhere when op x starts: per ancestor u of x read by x or a descendant of x, the largest
    tensor of u so read (at most u's output). `edges`: the graph's adjacency."""
    after = np.zeros(graph.num_nodes, dtype=bool)  # x and its descendants
    after[breadth_first_order(edges, x, directed=True, return_predecessors=False)] = True
    before = np.zeros(graph.num_nodes, dtype=bool)  # the ancestors of x
    before[breadth_first_order(edges.T.tocsr(), x, directed=True, return_predecessors=False)] = True
    before[x] = False
    src, dst = graph.edge_src, graph.edge_dst
    hit = before[src] & after[dst]
    per = np.zeros(graph.num_nodes)
    np.maximum.at(per, src[hit], np.minimum(graph.edge_bytes[hit], graph.output_bytes[src[hit]]))
    return float(per.sum())
