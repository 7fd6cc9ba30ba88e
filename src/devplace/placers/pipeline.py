"""`pipeline` ✱: cut the traversal order into contiguous pipeline stages and choose the micro-batch count.

What PipeDream's planner and Alpa's stage search do, over devplace's traversal order:

1. *Items.* A placement must keep each tie class (`devplace.graph.ties`: a forward op with its backward and
   optimizer ops) on one device, and a pipeline's stages are runs of forward ops. So the items are the
   forward ops, in a topological order that follows `order` (Kahn's algorithm over the forward ops, picking
   the ready op that comes first in `order`: a topological order is kept as it is, any other is made the
   nearest topological one). Each tie class is carried by its last forward op in that sequence: its compute
   per micro-batch (forward + backward ops of the class, / M), its once-per-step compute, its parameters, and
   its *stash* (the output bytes of its forward ops, held from the forward to the backward of a micro-batch).
   A graph without kinds is all forward; an op of a class without a forward op goes with the item of its
   first forward predecessor (else first predecessor, else first successor, else the last item), and
   counts there.
2. *Stages.* K = p * V stages (p devices, V chunks per device for interleaved-1f1b), stage k on the device at
   position k mod p (for `pipeline_plan`'s V-shaped schedules, zbv and dualpipev: position k, then 2p - 1 - k on
   the way back, `graph.schedule.stage_position`; the plan's `stage` says which of a device's two each op is in)
   of a device order (`device_orders`: by index on a cluster of identical devices; else
   fastest first and slowest first, each searched, and the schedule records it as its `device_order`);
   consecutive runs of the item sequence, possibly empty (so fewer devices may be used). A cut is
   *blocked* where a forward op's output would flow back to an earlier stage (its tie class is carried by an
   item after the cut, a consumer's before it): no schedule runs that, so no stage ends there. On a captured
   model (a graph with module paths) a cut is also blocked where the export could not cut (`cuts="modules"`,
   the default): unless the forward ops before it are the forward program up to a module call's beginning
   (where torch's pipelining splits; `devplace.graph.modules.segment_spans`), so that
   `devplace.runtime.export.pipeline_split` exports the stages as placed and the simulator judged the
   pipeline that runs. A coarse node whose ops straddle a module start cuts there no more than an op does.
3. *Cost model.* With t_k a stage's time per micro-batch (its ops' seconds on its device, `op_times`) and
   load_d the sum of device d's t_k, a pipelined step takes about sum_k t_k / V + M max_d load_d - max_k t_k
   (for V = 1: sum + (M - 1) max, the (M + p - 1)-slot formula of GPipe and 1F1B on a uniform chain without
   communication; for V chunks, M V + p - 1 slots, Megatron-LM's interleaved bubble). The transfer of the
   bytes that cross a cut (both directions, at the slowest link) is counted two ways, each giving
   candidates: added to the stage after the cut (it waits for it every micro-batch), or once in the sum (it
   overlaps compute). A device's once-per-step compute (the optimizer) adds its largest to the step.
   Memory of a stage: a lower bound on the simulator's peak of its device (`StageMemory`: its parameters +
   the larger of the micro-batches in flight times its stash, one fewer plus its largest op's working set, and
   its gradients), taken on the graph as run (`as_run`: the full graph under a coarsening, whose peak the
   search judges; a coarse group's memory is an estimate, which overstated gpt2-xl's peaks by 2.4 GB).
   It only prunes: no split the simulator finds within memory is rejected (tests/test_placer_pipeline.py
   checks it against every split of random chains); the simulator judges the rest.
4. *Search.* For each bound B on max_k t_k (a geometric grid, 2% apart, from the largest item to the whole
   work), a dynamic program over the cut points finds the split with the least sum_k t_k under B with every
   stage's memory bound within its device (compiled; O(K n^2) per bound with early exits, times K under
   1f1b, where a stage's micro-batches in flight depend on the non-empty stages after it, a dimension of the
   table; only the states a split within the bound can pass through are filled: under the tight bounds the
   search mostly runs, a narrow band of the table); the cost model ranks the splits. The placer itself is
   steps 1-4 (`stage_splits`): it returns the split the cost model ranks first, nothing simulated, as Alpa's
   and PipeDream's planners return their DP's split, with steps 5-6 as its adjust step (`PlacerOutput.adjust`),
   which the search runs after it (Baechi's place -> adjust -> simulate) before judging the answer;
   `pipeline_plan` runs both.
5. *Judge.* For each micro-batch count M (the setting, or each of `MICROBATCH_CHOICES`; under interleaved-1f1b
   those multiples of p) the best split of each way is simulated on the graph as run with the schedule
   (`devplace.sim.schedule`), then the next
   `CANDIDATES` - 1 of each way for the M that did best; the fastest memory-feasible one wins (ties: smaller
   M, then the cost model's rank). No retry loop: a split over memory as run is left to step 6.
6. *Refine.* The winner's cuts (where none fits: those of the split least over memory) are moved one at a time
   by `step` items either way under the simulator (pattern search: keep a move that shortens the simulated
   step within memory, or, while nothing fits, that brings the split within memory or nearer it; halve `step`
   when none does), at most `REFINE_SIMULATIONS` simulations: the cost model ranks splits, the simulator has
   the last word on each cut (while nothing fits, at most `FIT_SIMULATIONS`); nothing feasible: NoFitError.
   Once a split fits, a move whose stage memory bound is over a device (step 3) is not simulated: as run it is
   over memory too. Every split is simulated once for the graph as run and the cluster (`_OUTCOMES`), however
   many runs of the placer meet it (placer auto runs it under each order, view and micro-batch count).

The placer is registered cheap (a run is some tens of simulations, as greedy's), so `order="auto"` places
under every candidate order and keeps the fastest pipeline: which order gives the best forward sequence
depends on the model (CLIP-B/16 on 4xV100-16GB: critical-path's pipeline 2.2% faster than topo's; t5-small at
200 groups: dfs-preorder's 1.5x faster; docs/study/pipeline.md).

Settings: `schedule` ("gpipe", "1f1b", "interleaved-1f1b"), `microbatches` (None: choose), `chunks` (None: 1,
or 2 for interleaved), `cuts` ("modules": only where the export can cut a captured model, step 2; "ops": between
any forward ops, as on a graph without module paths, where the export then moves the cuts). The placer returns
its devices with the chosen schedule (`PlacerOutput`), so `devplace.place` judges it pipelined; `pipeline_plan()`
also gives the cut points and the scheduled result.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import pickle
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numba import njit

from devplace.defaults import MAX_CHUNKS, MAX_MICROBATCHES
from devplace.errors import DevplaceError
from devplace.graph.batch import divisors_text, graph_batch, graph_microbatches, microbatch_counts
from devplace.graph.compgraph import CompGraph
from devplace.graph.heap import heap_pop, heap_push
from devplace.graph.modules import segment_spans
from devplace.graph.schedule import V_SHAPED, chunk_stage, stage_position
from devplace.graph.tensors import tensor_groups
from devplace.graph.ties import tie_classes
from devplace.hardware.cluster import Cluster, op_times, step_times
from devplace.placers.common import positive_int
from devplace.placers.memory import no_fit_error, unrunnable_error
from devplace.placers.registry import FullGraph, PlacerError, PlacerOutput, register
from devplace.sim.bounds import op_holds
from devplace.sim.schedule import (
    BACKWARD,
    FORWARD,
    KINDS,
    PER_STEP,
    Schedule,
    ScheduledResult,
    ScheduleError,
    actions,
    op_phases,
    simulate_schedule,
)

MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32)
CANDIDATES = 2  # splits simulated per micro-batch count and way of counting transfers
GRID_RATIO = 1.02  # spacing of the bounds on the slowest stage
REFINE_SIMULATIONS = 64  # at most this many simulated moves of a cut when refining the judged best split
FIT_SIMULATIONS = 16  # of which at most this many while no split tried is within memory
CUTS = ("modules", "ops")  # the `cuts` setting: where a captured model's stages may begin
# the schedules `pipeline_plan` (the function) cuts for: the placer's own, and the V-shaped ones, whose 2p stages a
# placement alone cannot record (the turn's two stages share a device); their plans carry each op's stage
PLAN_KINDS = (*KINDS, *V_SHAPED)


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline placement: device per node, the schedule it was chosen for, its simulated result, the cut
    points (positions in the item sequence, one end per stage) and each node's stage (which, under a V-shaped
    schedule, the devices do not tell: stages p - 1 and p share one)."""

    devices: np.ndarray
    schedule: Schedule
    result: ScheduledResult
    cuts: tuple[int, ...]
    stage: np.ndarray  # int64[V], each node's pipeline stage, 0..p V - 1 along the data (on `schedule`'s positions)

    @property
    def step_time_s(self) -> float:
        return self.result.step_time_s


# --------------------------------------------------------------------------- items


@dataclass(frozen=True)
class _Items:
    nodes: np.ndarray  # int64[n], the forward op carrying each item, in sequence order
    owner: np.ndarray  # int64[V], the item whose device each node takes
    work: np.ndarray  # float64[n, D], seconds of the class run per micro-batch on each device (the graph's batch)
    step_work: np.ndarray  # float64[n, D], seconds of the class run once per step on each device
    cross: np.ndarray  # float64[n + 1], bytes crossing a cut before item i, both directions (whole batch)
    blocked: np.ndarray  # bool[n + 1], True where no stage may end before item i (module docstring, step 2)
    stops: np.ndarray  # int64, the places `_refine` moves cuts among: 0..n, or those between segments


def _forward_ops(graph: CompGraph) -> np.ndarray:
    """bool per node: the ops that make the items (forward ops; every op of a graph without one)."""
    fwd = op_phases(graph) == FORWARD
    return fwd if fwd.any() else np.ones(graph.num_nodes, dtype=bool)


def forward_sequence(graph: CompGraph, order: np.ndarray, segments: np.ndarray | None = None) -> np.ndarray:
    """The items' sequence (step 1 of the module docstring): the forward ops in the topological order nearest
    to `order` (Kahn's algorithm over the forward ops, the ready op earliest in `order` first). The placer's
    result depends on the order only through it, so orders with equal sequences place alike.

    With `segments` (per node, the first segment of its forward ops, -1 for none: `segment_spans`), that
    sequence is then reordered segment by segment (Kahn again, the ready op of the earliest segment first, then
    the earliest in the sequence): the forward program runs its segments one after the other, so this is a
    topological order in which stages can end between segments (where the order nearest `order` can interleave
    them: a mask or a position table built early, used late)."""
    n_nodes = graph.num_nodes
    fwd = _forward_ops(graph)
    pos = np.empty(n_nodes, dtype=np.int64)
    pos[np.asarray(order, dtype=np.int64)] = np.arange(n_nodes)
    seq = _kahn(graph, fwd, pos)
    if segments is None or not (segments >= 0).any():
        return seq  # no segments: reordering by the sequence itself gives the sequence
    rank = np.zeros(n_nodes, dtype=np.int64)
    rank[seq] = np.arange(seq.shape[0])
    return _kahn(graph, fwd, segments * (n_nodes + 1) + rank)


def _kahn(graph: CompGraph, fwd: np.ndarray, priority: np.ndarray) -> np.ndarray:
    """The `fwd` nodes in a topological order of the edges among them, the ready node of least `priority`
    first (priorities distinct among them)."""
    return _kahn_compiled(graph.num_nodes, graph.edge_src, graph.edge_dst, graph.succ_ptr, graph.succ_edges,
                          np.asarray(fwd, dtype=np.bool_), np.asarray(priority, dtype=np.int64))


@njit(cache=True)
def _kahn_compiled(n_nodes, edge_src, edge_dst, succ_ptr, succ_edges, fwd, priority):  # pragma: no cover - compiled
    """`_kahn` over the graph's columns (its out-edges as CSR, each node's in edge order)."""
    indeg = np.zeros(n_nodes, dtype=np.int64)
    for e in range(edge_src.shape[0]):
        if fwd[edge_src[e]] and fwd[edge_dst[e]]:
            indeg[edge_dst[e]] += 1  # per edge: parallel edges count as often as they are released below
    ht = np.zeros(n_nodes)  # one time for all: the heap orders by priority alone
    hk = np.empty(n_nodes, dtype=np.int64)
    hp = np.empty(n_nodes, dtype=np.int64)
    size = 0
    for v in range(n_nodes):
        if fwd[v] and indeg[v] == 0:
            size = heap_push(ht, hk, hp, 0, size, 0.0, priority[v], v)
    seq = np.empty(n_nodes, dtype=np.int64)
    count = 0
    while size > 0:
        u = hp[0]
        size = heap_pop(ht, hk, hp, 0, size)
        seq[count] = u
        count += 1
        for x in range(succ_ptr[u], succ_ptr[u + 1]):
            w = edge_dst[succ_edges[x]]
            if fwd[w]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    size = heap_push(ht, hk, hp, 0, size, 0.0, priority[w], w)
    return seq[:count]


def _items(graph: CompGraph, order: np.ndarray, classes: np.ndarray, times: np.ndarray, once: np.ndarray,
           cuts: str) -> _Items:
    """Step 1 of the module docstring; `times` every op's seconds on every device, `once` the part of them that
    runs once per step (`step_times`); `cuts` the setting (where stages may be cut)."""
    fwd = _forward_ops(graph)
    spans = graph.derived("segment_spans", segment_spans) if cuts == "modules" else None
    seq = forward_sequence(graph, order, None if spans is None else spans[:, 0])
    n = seq.shape[0]
    classes = np.asarray(classes, dtype=np.int64)
    # each class's item: its last forward op's in the sequence (an input tied to its consumer goes with the
    # consumer); -1 for a class without one
    class_item = np.full(int(classes.max(initial=-1)) + 1, -1, dtype=np.int64)
    np.maximum.at(class_item, classes[seq], np.arange(n, dtype=np.int64))
    owner = class_item[classes]
    # an op of a class without a forward op goes with the item of its first forward predecessor (a backward
    # op with the activations it reads), else of its first predecessor (an optimizer op with its gradient),
    # else of its first successor, else the last item; so its compute, parameters and optimizer state count
    # where it will run. On a graph without tie groups every backward and optimizer op is such an op.
    # (each loop visits only the ops without an item when it starts: a visit sets no other op's)
    topo = graph.topo_order
    for v in topo[owner[topo] < 0].tolist():
        placed = sorted((not fwd[u], k, int(owner[u])) for k, u in enumerate(graph.predecessors(v)) if owner[u] >= 0)
        owner[v] = placed[0][2] if placed else -1
    reverse = topo[::-1]
    for v in reverse[owner[reverse] < 0].tolist():
        placed = [int(owner[w]) for w in graph.successors(v) if owner[w] >= 0]
        owner[v] = placed[0] if placed else n - 1
    # per micro-batch and once per step: a coarse group may hold a layer's backward ops with its optimizer update
    work = np.stack([np.bincount(owner, weights=col, minlength=n) for col in (times - once).T], axis=1)
    step_work = np.stack([np.bincount(owner, weights=col, minlength=n) for col in once.T], axis=1)
    # cut i (before item i) is crossed by a tensor whose producer's item and a consumer's item lie on
    # different sides: forward from the producer to its last consumer, backward to its first
    groups = tensor_groups(graph)
    consumer = owner[graph.edge_dst]
    lows = np.full(groups.num_groups, n, dtype=np.int64)
    highs = np.full(groups.num_groups, -1, dtype=np.int64)
    np.minimum.at(lows, groups.edge_group, consumer)
    np.maximum.at(highs, groups.edge_group, consumer)
    diff = _crossings(n, np.argsort(groups.first_edge, kind="stable"), owner[graph.edge_src[groups.first_edge]],
                      lows, highs, graph.edge_bytes[groups.first_edge].astype(np.float64))
    cross = np.cumsum(diff)[: n + 1]
    # a forward edge u -> v runs from the stage of u's item to the stage of v's item; where u's item comes
    # later (u's tie class is carried by a later op), every cut between the two would make it flow back to an
    # earlier stage, which no schedule runs: those cuts are blocked
    inside = np.zeros(n + 2, dtype=np.int64)
    fe = fwd[graph.edge_src] & fwd[graph.edge_dst]
    lo, hi = owner[graph.edge_dst[fe]], owner[graph.edge_src[fe]]
    back = lo < hi
    np.add.at(inside, lo[back] + 1, 1)
    np.add.at(inside, hi[back] + 1, -1)
    blocked = np.cumsum(inside)[: n + 1] > 0
    within = _between_segments(spans, owner, n) if spans is not None else np.zeros(n + 1, dtype=bool)
    blocked |= within
    # an item may own no op (its forward op's tie class is carried by a later item): a cut just after it leaves
    # the same ops on each side as the cut before it, so blocking it loses no split, and a stage can no longer
    # consist of such items alone, a stage of no ops that the "no stage left empty" rule (it counts items) let by
    blocked[1:n] |= np.bincount(owner, minlength=n)[: n - 1] == 0
    return _Items(np.asarray(seq, dtype=np.int64), owner, work, step_work, cross, blocked, np.flatnonzero(~within))


@njit(cache=True)
def _crossings(n, tensors, producer, lows, highs, nbytes):  # pragma: no cover - compiled
    """The differences of the bytes crossing each cut (`_items`), tensor by tensor in the order `tensors`: forward
    from its producer's item a to its last consumer's (hi), backward to its first consumer's (lo)."""
    diff = np.zeros(n + 2)
    for t in tensors:
        a, lo, hi, b = producer[t], lows[t], highs[t], nbytes[t]
        if hi > a:
            diff[a + 1] += b
            diff[hi + 1] -= b
        if lo < a:
            diff[lo + 1] += b
            diff[a + 1] -= b
    return diff


def _between_segments(spans: np.ndarray, owner: np.ndarray, n: int) -> np.ndarray:
    """bool[n + 1]: True where a cut before item i is within a segment (`segment_spans`, per node; all
    (-1, -1) on a graph without module paths, which blocks nothing): some segment has forward ops both in the
    items before the cut and in those after it."""
    has = spans[:, 0] >= 0
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(n, -1, dtype=np.int64)
    np.minimum.at(first, owner[has], spans[has, 0])
    np.maximum.at(last, owner[has], spans[has, 1])
    before = np.maximum.accumulate(np.concatenate([[-1], last]))  # the last segment of the items before cut i
    after = np.minimum.accumulate(np.concatenate([first, [np.iinfo(np.int64).max]])[::-1])[::-1]
    return before >= after


# --------------------------------------------------------------------------- the dynamic program


class StageMemory:
    """What the dynamic program knows of memory: a lower bound on the simulator's peak of the device that runs a
    stage, for every stage [i, j) of the items (module docstring, step 3), on the graph the placer is judged on
    (a micro-batch's bytes are the graph's / div: M for a whole step's graph, 1 for one captured at the
    micro-batch size).

    - `params[i]`: the parameter bytes of the ops of items before i, held all step where they are placed;
    - `stash[i, j]`: the output bytes of the forward ops of items i..j-1 that a backward op of the same items
      reads (one micro-batch's);
    - `op_need[i]`: the most that one op of item i (forward or backward, taking time) holds when it starts: its
      inputs, output and scratch;
    - `grads[i]`: the output bytes of items before i's micro-batch ops that an op of their own item run once per
      step reads (the gradients the optimizer reads).

    Stages begin and end only where a stage may end (`at`: 0, the unblocked cuts, n), so every figure is kept
    per run of items between two such places (R runs; `stash` is R + 1 square, 10x smaller than per item on
    gpt2-xl's 1,379 items in 437 runs): indices below are runs, and `bound` takes item cuts.

    A stage [i, j) whose device runs n forward actions before its first backward action (`inflight`) holds at
    least params + max(n stash, (n - 1) stash + op_need, grads) (`bound`): when that backward action starts,
    each of those n forwards' outputs that a backward op of the stage reads is held (allocated when its op
    started, freed only when its readers on the device have finished, which run from then on and take time);
    while an op of the n-th forward or of the first backward action runs, the other n - 1 micro-batches' are,
    beside what the op holds (its inputs are held until it finishes, its output and scratch from its start);
    when the first once-per-step op starts, every gradient of the last micro-batch that such an op reads is.
    Only what a reader that takes time holds is counted (an op of no time holds nothing, DESIGN.md section 4)."""

    at: np.ndarray  # int64[R + 1], the item where each run begins, then n
    params: np.ndarray  # float64[R + 1]
    stash: np.ndarray  # float64[R + 1, R + 1], the graph's bytes
    op_need: np.ndarray  # float64[R], the graph's bytes
    grads: np.ndarray  # float64[R + 1], the graph's bytes

    def __init__(self, judged: CompGraph, item_of: np.ndarray, blocked: np.ndarray, cluster: Cluster) -> None:
        """`judged`: the graph the placer is judged on; `item_of`: the item each of its nodes goes with;
        `blocked`: per place 0..n, True where no stage may end (`_Items.blocked`)."""
        free = ~np.asarray(blocked, dtype=bool)
        free[[0, -1]] = True  # the sequence's ends
        self.at = np.flatnonzero(free)
        n = self.at.size - 1  # runs
        item_of = np.searchsorted(self.at, item_of, side="right") - 1  # the run of each node

        def prefix(weights: np.ndarray) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum(np.bincount(item_of, weights=weights, minlength=n))])

        self.params = prefix(judged.param_bytes)
        phase = op_phases(judged)
        runs = np.logical_and.reduce([col > 0 for col in op_times(judged, cluster).T])  # time on every device
        u, w = judged.edge_src, judged.edge_dst
        b = judged.output_bytes
        read = (phase[u] == FORWARD) & (phase[w] == BACKWARD) & runs[w]
        a, c = item_of[u[read]], item_of[w[read]]
        # per forward op: the nearest item at or before its own (lo) and at or after it (hi) with a reader
        lo = np.full(judged.num_nodes, -1, dtype=np.int64)
        hi = np.full(judged.num_nodes, n, dtype=np.int64)
        np.maximum.at(lo, u[read], np.where(c <= a, c, -1))
        np.minimum.at(hi, u[read], np.where(c >= a, c, n))
        own = item_of
        # stage [i, j) holds op v's output when it holds v's item and one of its readers: i <= lo (lo <= own < j)
        # or hi < j (i <= own <= hi); counted by inclusion-exclusion as sums over x >= i, y < j of a grid
        grid = np.zeros((n + 1, n + 1))
        has_lo, has_hi = lo >= 0, hi < n
        np.add.at(grid, (lo[has_lo], own[has_lo]), b[has_lo])
        np.add.at(grid, (own[has_hi], hi[has_hi]), b[has_hi])
        both = has_lo & has_hi
        np.add.at(grid, (lo[both], hi[both]), -b[both])
        table = np.cumsum(grid[::-1], axis=0)[::-1]  # rows: x >= i
        self.stash = np.zeros((n + 1, n + 1))
        self.stash[:, 1:] = np.cumsum(table, axis=1)[:, :n]  # columns: y < j
        # one op's inputs, output and scratch (`op_holds`)
        mb = phase != PER_STEP
        need = np.where(mb & runs, op_holds(judged), 0.0)
        self.op_need = np.zeros(n)
        np.maximum.at(self.op_need, item_of, need)
        # gradients: a micro-batch op's output read by an op of its item that runs once per step and takes time
        feeds = mb[u] & (phase[w] == PER_STEP) & runs[w] & (item_of[u] == item_of[w])
        held = np.zeros(judged.num_nodes, dtype=bool)
        held[u[feeds]] = True
        self.grads = prefix(np.where(held, b, 0.0))

    def bound(self, cuts: tuple[int, ...], schedule: Schedule, div: float) -> np.ndarray:
        """The lower bound of each stage of the split `cuts` (stage ends, places in `at`), as the dynamic program
        counts it."""
        cuts = tuple(int(x) for x in np.searchsorted(self.at, cuts))
        starts = (0, *cuts[:-1])
        nonempty = [j > i for i, j in zip(starts, cuts, strict=True)]
        fixed = inflight(schedule, len(cuts) // int(schedule.chunks or 1), all(nonempty))
        out = np.zeros(len(cuts))
        for k, (i, j) in enumerate(zip(starts, cuts, strict=True)):
            if j > i:
                n = min(sum(nonempty[k + 1:]) + 1, schedule.microbatches) if schedule.kind == "1f1b" else fixed[k]
                out[k] = _stage_bound(self.params[j] - self.params[i], self.stash[i, j] / div,
                                      float(self.op_need[i:j].max()) / div, (self.grads[j] - self.grads[i]) / div,
                                      int(n))
        return out


GPIPE, ONE_F_ONE_B, INTERLEAVED = 0, 1, 2  # schedule kinds, as the compiled dynamic program takes them


def _kind_code(schedule: Schedule) -> int:
    return {"gpipe": GPIPE, "1f1b": ONE_F_ONE_B}.get(schedule.kind, INTERLEAVED)


def inflight(schedule: Schedule, p: int, full: bool) -> np.ndarray:
    """Per stage k (chunk k // p at position k mod p of `p` devices; V-shaped: `stage_position`), the forward
    actions of its chunk that its device runs before its first backward action (`StageMemory`), where it does not
    depend on the other stages: M under gpipe; interleaved, zero bubble and V-shaped, as the schedule orders them
    (`actions`) when every stage holds items (`full`: all p devices in the pipeline), else 1 (the first
    micro-batch of every chunk comes first). Under 1f1b the dynamic program counts it: position r of p' used
    devices warms up with p' - r - 1 forwards (the non-empty stages after it), then runs one more, at most M
    (here: 1)."""
    v = int(schedule.chunks or 1)
    out = np.ones(p * v, dtype=np.int64)
    if schedule.kind == "gpipe":
        out[:] = schedule.microbatches
    elif schedule.kind != "1f1b" and full:
        for r in range(p):
            before = itertools.takewhile(lambda a: a[0] == FORWARD, actions(schedule, p, r))
            chunks = np.bincount([c for _, c, _ in before], minlength=v)
            out[[chunk_stage(schedule.kind, c, r, p) for c in range(v)]] = chunks
    return out


@njit(cache=True)
def _stage_bound(weights, held, big, grad, n):  # pragma: no cover - compiled
    """`StageMemory.bound` of one stage from its sums."""
    return weights + max(n * held, (n - 1) * held + big, grad)


@njit(cache=True)
def _split(bound, pre_time, at, params, stash, op_need, grads, cap, kind, m, fixed, full, div, cross, comm_Bps,
           latency, waits):  # pragma: no cover - compiled
    """Cut ends (one per stage, none at a `blocked` cut) minimising the sum of stage times with every stage
    time <= bound and every stage's memory lower bound (`StageMemory`) within its device's `cap`; per-micro-batch
    figures are the graph's / div (M for a whole step's graph, 1 for one captured at the micro-batch size). A
    stage's time per micro-batch is its compute plus, with `waits`, the transfer of what crosses its first cut
    (activations forward, gradients back); without, that transfer only adds to the sum (it overlaps the other
    micro-batches' compute).

    Stages begin and end at the places `at` (`StageMemory`, whose figures are per run between them). Solved from
    the last stage back: f[k, r, c] is the least sum for runs r..R-1 in stages k..K-1 of which c are non-empty
    (under 1f1b a stage's micro-batches in flight depend on that count; other kinds keep c = 0 and take them
    from `fixed`, per stage, `inflight`; with `full`, every stage holds items). Returns the stage ends (items),
    or ends[0] = -1 when nothing fits."""
    n = at.shape[0] - 1
    k_stages = pre_time.shape[0]
    counts = k_stages + 1 if kind == ONE_F_ONE_B else 1
    inf = np.inf
    f = np.full((k_stages + 1, n + 1, counts), inf)
    nxt = np.full((k_stages + 1, n + 1, counts), -1, dtype=np.int64)
    f[k_stages, n, 0] = 0.0
    # only the states a split within the bound can pass through: stages k.. begin at a run i that the first k stages
    # can reach (i <= far[k]: each stage as far as its compute within the bound takes it) and from which the stages
    # from k on can cover the rest (i >= near[k]); the others cannot be on such a split (their f stays inf, as the
    # full table has it), and stage times only add transfers to compute, so both limits are on compute alone
    far = np.zeros(k_stages + 1, dtype=np.int64)
    near = np.full(k_stages + 1, n, dtype=np.int64)
    for k in range(k_stages):
        j = far[k]
        while j < n and (pre_time[k, at[j + 1]] - pre_time[k, at[far[k]]]) / div <= bound:
            j += 1
        far[k + 1] = j
    for k in range(k_stages - 1, -1, -1):
        i = near[k + 1]
        while i > 0 and (pre_time[k, at[near[k + 1]]] - pre_time[k, at[i - 1]]) / div <= bound:
            i -= 1
        near[k] = i
    for k in range(k_stages - 1, -1, -1):
        for i in range(near[k], far[k] + 1):
            for c in range(counts if not full else 0):  # an empty stage
                if f[k + 1, i, c] < f[k, i, c]:
                    f[k, i, c] = f[k + 1, i, c]
                    nxt[k, i, c] = i
            if i == n:
                continue
            comm = latency + cross[at[i]] / div / comm_Bps if i > 0 else 0.0
            # a stage ending before near[k + 1] leaves the stages after it more than they can cover: start at the
            # first end that does not (time and memory only grow with the end, so what stops the loop stops it there)
            first = max(i + 1, near[k + 1])
            big = 0.0
            for x in range(i, first - 1):
                big = max(big, op_need[x] / div)
            for j in range(first, n + 1):
                t = (pre_time[k, at[j]] - pre_time[k, at[i]]) / div + (comm if waits else 0.0)
                if t > bound:
                    break
                big = max(big, op_need[j - 1] / div)
                weights = params[j] - params[i]
                held = stash[i, j] / div
                grad = (grads[j] - grads[i]) / div
                least = min(1, m) if kind == ONE_F_ONE_B else fixed[k]
                if _stage_bound(weights, held, big, grad, least) > cap[k]:
                    break  # more items only add
                for c in range(counts - 1 if counts > 1 else 1):
                    n_in = min(c + 1, m) if kind == ONE_F_ONE_B else fixed[k]
                    if _stage_bound(weights, held, big, grad, n_in) > cap[k]:
                        break  # more stages after it only add micro-batches in flight
                    base = f[k + 1, j, c]
                    if base == inf:
                        continue
                    here = c + 1 if counts > 1 else 0
                    value = base + t + (0.0 if waits else comm)
                    if value < f[k, i, here]:
                        f[k, i, here] = value
                        nxt[k, i, here] = j
    ends = np.full(k_stages, -1, dtype=np.int64)
    c = 0
    for x in range(counts):
        if f[0, 0, x] < f[0, 0, c]:
            c = x
    if f[0, 0, c] == inf:
        return ends
    i = 0
    for k in range(k_stages):
        j = nxt[k, i, c]
        ends[k] = at[j]
        if j > i and counts > 1:
            c -= 1
        i = j
    return ends


def _per_microbatch(schedule: Schedule) -> float:
    """What a micro-batch's compute and bytes are divided by: M when the graph is the whole step's, 1 when it
    was captured at the micro-batch size."""
    return 1.0 if schedule.microbatch_graph else float(schedule.microbatches)


def device_orders(graph: CompGraph, cluster: Cluster, times: np.ndarray | None = None) -> list[tuple[int, ...]]:
    """The orders of the devices along the pipeline that the placer tries (position r runs stage r): by index
    on a cluster whose devices all take the same time for the graph; else fastest first and slowest first (the
    slow devices early can be the better, as they hold the most micro-batches' activations under 1F1B), so that
    the answer does not depend on the order a cluster file lists its devices in (ties: by index). `times`:
    `op_times(graph, cluster)`, where the caller has it."""
    total = (op_times(graph, cluster) if times is None else times).sum(axis=0)
    if np.all(total == total[0]):
        return [tuple(range(cluster.num_devices))]
    fast = tuple(int(d) for d in np.lexsort((np.arange(total.size), total)))
    slow = tuple(int(d) for d in np.lexsort((np.arange(total.size), -total)))
    return list(dict.fromkeys([fast, slow]))


class _Search:
    def __init__(self, graph: CompGraph, cluster: Cluster, items: _Items, memory: StageMemory,
                 device_order: tuple[int, ...]) -> None:
        self.graph, self.cluster = graph, cluster
        self.perm = np.asarray(device_order, dtype=np.int64)  # the device at each pipeline position
        self.items = it = items
        self.memory = memory
        # [D, n + 1] prefix sums of the items' seconds on each device
        self.pre_work = np.concatenate([np.zeros((1, cluster.num_devices)), np.cumsum(it.work, axis=0)]).T.copy()
        self.pre_step = np.concatenate([np.zeros((1, cluster.num_devices)), np.cumsum(it.step_work, axis=0)]).T.copy()
        fastest = it.work.min(axis=1)  # each item's seconds on its fastest device
        self.fastest_max, self.fastest_sum = float(fastest.max(initial=0.0)), float(fastest.sum())
        bw = cluster.bandwidth[~np.eye(cluster.num_devices, dtype=bool)]
        lat = cluster.latency[~np.eye(cluster.num_devices, dtype=bool)]
        self.comm_Bps = float(bw.min()) if bw.size else math.inf
        self.latency = float(lat.max()) if lat.size else 0.0
        self._made: dict[tuple[Schedule, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # `_inputs`

    def splits(self, schedule: Schedule, waits: bool, keep: int,
               full: bool = False) -> list[tuple[float, tuple[int, ...]]]:
        """(model step time, cut ends) of the `keep` best distinct splits found under the bounds, best first
        (`waits`: see `_split`; `full`: no stage left empty, as an interleaved pipeline needs).

        The bounds rise from the smallest possible slowest stage; a split first found under a bound has its
        slowest stage above the previous bound B (one within B would have been found there, ties aside), so its
        model step is at least W / V + (M - 1) B, W the work of the items each on its fastest device. Once that
        is no better than the `keep`-th best found, no later bound can add one of the `keep` best and the
        search stops (at M = 1 it walks every bound)."""
        v = int(schedule.chunks or 1)
        m = _per_microbatch(schedule)
        pre = self._inputs(schedule, full)[0]
        total = float(pre[:, -1].max()) / m
        # no split's slowest stage is below the one where every stage's device does an equal share of the time:
        # stage k doing a fraction f_k of the work takes f_k * total_k, and the fractions sum to 1
        share = 1.0 / float(np.sum(m / pre[:, -1])) if np.all(pre[:, -1] > 0) else 0.0
        lo = max(self.fastest_max / m, share)
        least = self.fastest_sum / m / v
        found: dict[tuple[int, ...], float] = {}
        kth = math.inf  # the keep-th least model step found
        args = self._args(schedule, waits, full)  # the dynamic program's arguments after the bound

        def split(bound: float) -> bool:
            nonlocal kth
            ends = _split(bound, *args)
            if ends[0] < 0:
                return False
            cuts = tuple(ends.tolist())
            if cuts not in found:  # neighbouring bounds often find the same split
                found[cuts] = self.model_time(cuts, schedule, waits)
                if len(found) >= keep:
                    kth = sorted(found.values())[keep - 1]
            return True

        # a split within memory under some bound is one under the loosest: when there is none, none fits
        if not split(total):
            return []
        bound = lo
        while True:
            split(bound)
            if bound >= total or lo <= 0:
                break
            if least + (schedule.microbatches - 1) * bound >= kth:
                break
            bound = min(bound * GRID_RATIO, total)
        return sorted((t, c) for c, t in found.items())[:keep]

    def _inputs(self, schedule: Schedule, full: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What `_split` takes for `schedule` beside the bound, made once per schedule: [K, n + 1] stage k's prefix
        sums of the items' seconds on its device, each stage's memory cap, and its micro-batches in flight
        where they do not depend on the split (`inflight`)."""
        key = (schedule, full)
        if key not in self._made:
            p = self.cluster.num_devices
            dev = self.perm[self.positions(schedule)]
            # the memory bound only prunes: a stage is dropped only where no schedule could hold it (float rounding
            # of the bound's sums must not drop a split the simulator finds within memory to the byte)
            cap = (self.cluster.memory[dev] * (1 + 1e-9)).astype(np.float64)
            self._made[key] = (np.ascontiguousarray(self.pre_work[dev]), cap, inflight(schedule, p, full))
        return self._made[key]

    def positions(self, schedule: Schedule) -> np.ndarray:
        """int64[p V]: the pipeline position of each stage under `schedule` (`stage_position`: k mod p, round the
        devices; V-shaped, out along the positions and back)."""
        p = self.cluster.num_devices
        return np.array([stage_position(schedule.kind, k, p) for k in range(p * int(schedule.chunks or 1))],
                        dtype=np.int64)

    def _args(self, schedule: Schedule, waits: bool, full: bool) -> tuple[Any, ...]:
        """The arguments of the dynamic program (`_split`) after the bound."""
        pre, cap, fixed = self._inputs(schedule, full)
        return (pre, self.memory.at, self.memory.params, self.memory.stash, self.memory.op_need, self.memory.grads,
                cap, _kind_code(schedule), schedule.microbatches, fixed, full, _per_microbatch(schedule),
                self.items.cross, self.comm_Bps, self.latency, waits)

    def split_under(self, schedule: Schedule, bound: float, waits: bool, full: bool) -> tuple[int, ...] | None:
        """The dynamic program (`_split`) under one bound on the slowest stage: the split of least sum of stage
        times with every stage within `bound` and its memory bound within its device, or None."""
        ends = _split(bound, *self._args(schedule, waits, full))
        return tuple(ends.tolist()) if ends[0] >= 0 else None

    def model_time(self, cuts: tuple[int, ...], schedule: Schedule, waits: bool) -> float:
        """The cost model's step: sum_k t_k / V + M max_d load_d - max_k t_k, load_d = the time of device d's
        stages per micro-batch (exact on a uniform chain for any V, where the bubble is (p - 1) t_k), plus the
        largest once-per-step compute of a device (its optimizer runs after its last micro-batch)."""
        m, v, p = schedule.microbatches, int(schedule.chunks or 1), self.cluster.num_devices
        div = _per_microbatch(schedule)
        n = self.pre_work.shape[1] - 1
        # in floats, stage by stage (a dozen stages: numpy's per-call cost was most of it), summed as before: per
        # device in stage order, and the stages' times by numpy (its pairwise sum, from 8 items on, rounds otherwise)
        t = [0.0] * len(cuts)
        comm = 0.0
        load, step = [0.0] * p, [0.0] * p
        on = self.positions(schedule).tolist()
        i = 0
        for k, j in enumerate(cuts):
            d = int(self.perm[on[k]])
            if j > i:
                t[k] = float(self.pre_work[d, j] - self.pre_work[d, i]) / div
                if 0 < i < n:
                    c = self.latency + float(self.items.cross[i]) / div / self.comm_Bps
                    if waits:
                        t[k] += c
                    else:
                        comm += c
            load[on[k]] += t[k]
            step[on[k]] += float(self.pre_step[d, j] - self.pre_step[d, i])
            i = j
        return float(np.sum(t)) / v + comm + m * max(load) - max(t) + max(step)

    def over_memory(self, cuts: tuple[int, ...], schedule: Schedule) -> bool:
        """Whether a stage of the split `cuts` is over its device's memory by the lower bound (`StageMemory`):
        the simulator would find it over memory too."""
        need = self.memory.bound(cuts, schedule, _per_microbatch(schedule))
        cap = self.cluster.memory[self.perm[self.positions(schedule)]]
        return bool((need > cap * (1 + 1e-9)).any())

    def stages(self, cuts: tuple[int, ...]) -> np.ndarray:
        """Stage per node: items by the cuts, every op with its owning item (tie classes with their item, classes
        without a forward op as `_items` says)."""
        it = self.items
        stage_of_item = np.searchsorted(np.asarray(cuts), np.arange(it.nodes.shape[0]), side="right")
        return stage_of_item[it.owner]

    def devices(self, cuts: tuple[int, ...], schedule: Schedule) -> np.ndarray:
        """Device per node: stage k (`stages`) on the device at its position under `schedule` (`positions`)."""
        return self.perm[self.positions(schedule)[self.stages(cuts)]]


def _unrunnable(graph: CompGraph, stage: np.ndarray, device: np.ndarray, s: Schedule) -> str | None:
    """Why torch's pipelining would not run the pipeline of each op's `stage` (the simulator's numbers, chunk * p +
    position; -1 for per-step ops) on `device`, None when it would: its schedule on its devices
    (`Schedule.unrunnable`: 1f1b with at least as many micro-batches as stages), and under V > 1 chunks per device
    all p V stages in order along the program, as the export sees them (`_program_stages`)."""
    staged = stage >= 0
    p = np.unique(device[staged]).size
    v = int(s.chunks or 1)
    why = s.unrunnable(p)
    # the simulator numbers a stage chunk * p + position; along the data they go round the devices (V-shaped:
    # out and back)
    want = [k // p * p + stage_position(s.kind, k, p) for k in range(p * v)]
    if why is None and v > 1 and (met := _program_stages(graph, stage)) != want:
        how = "out and back along" if s.kind in V_SHAPED else f"{v} rounds of"
        why = (f"the program meets its stages in the order {met}, not the {p * v} stages {want} of "
               f"{how} the {p} devices that a {s.kind} schedule runs")
    return why


def _program_stages(graph: CompGraph, stage: np.ndarray) -> list[int]:
    """The stages met along the forward program, as the export cuts it: on a captured model each segment between
    module starts (`segment_spans`) goes to the stage with most of its compute, and runs of one stage count once
    (a constant that the simulator puts in stage 0, being a source, does not make a stage of its own: the
    export runs it where it lies in the program); without module paths, the stages of the forward ops in order."""
    first = graph.derived("segment_spans", segment_spans)[:, 0]
    ops = np.flatnonzero((stage >= 0) & (first >= 0))
    if ops.size:
        # one weighted count over (segment, stage) pairs, each row's argmax its stage (the first of equals): the
        # placer asks this of every V split it judges, and a loop over a captured model's 10^3 segments was a
        # fifth of the parallel plans' search (gpt2-xl b8 on a mixed cluster: 5.5 of 27 s); each pair sums its
        # ops in index order, as a bincount per segment did, so the sums and the answer are the same
        segs, seg_of = np.unique(first[ops], return_inverse=True)
        width = int(stage[ops].max()) + 1
        weight = np.bincount(seg_of * width + stage[ops], weights=graph.compute_s[ops] + 1e-300,
                             minlength=segs.size * width)
        seq = np.argmax(weight.reshape(segs.size, width), axis=1).tolist()
    else:
        seq = stage[op_phases(graph) == FORWARD].tolist()
    return [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]


@dataclass(frozen=True)
class _Outcome:
    """What the placer keeps of a simulated split: its step, whether it fits memory, and by how much it does not
    (the sum of its devices' excess)."""

    step_time_s: float
    feasible: bool
    over_bytes: float


# per graph as run (while it lives) and cluster: (schedule, device per op) -> outcome, or why it is no pipeline torch
# runs. Placer auto places a pipeline under each order, view of the graph (folded, tied, finer groups) and
# micro-batch count it tries, and those runs simulate many of the same splits of the same graph again (gpt2-xl's
# interleaved pipeline that fits nowhere: 498 simulations in 24 runs); each is simulated once.
_OUTCOMES: weakref.WeakKeyDictionary[CompGraph, dict[bytes, dict[tuple[Schedule, bytes], _Outcome | str]]] = (
    weakref.WeakKeyDictionary())


class _Judge:
    """Simulates each (schedule, split) once on the graph the placer is judged on (`_OUTCOMES`), keeps the best
    feasible one and, while none is, the one least over memory (the sum of its devices' excess)."""

    def __init__(self, judged: FullGraph, cluster: Cluster, search: _Search) -> None:
        self.judged, self.cluster, self.search = judged, cluster, search
        self.outcomes = _OUTCOMES.setdefault(judged.graph, {}).setdefault(pickle.dumps(cluster), {})
        self.simulated: dict[tuple[Schedule, tuple[int, ...]], _Outcome | None] = {}
        self.results: dict[tuple[Schedule, tuple[int, ...]], ScheduledResult] = {}  # those simulated here that fit
        self.best: tuple[float, int, int, Schedule, tuple[int, ...]] | None = None
        self.least_over: tuple[float, Schedule, tuple[int, ...]] | None = None
        self.refused: str | None = None  # why the first split that is no pipeline torch runs is not

    def simulate(self, s: Schedule, cuts: tuple[int, ...]) -> tuple[ScheduledResult | None, str | None]:
        """The split simulated as run, or None and why it is no pipeline torch's pipelining runs."""
        expand, graph, p = self.judged.expand, self.judged.graph, self.cluster.num_devices
        devices, chunk = expand(self.search.devices(cuts, s)), None
        if s.kind in V_SHAPED:
            # a V's turn runs two stages on one device: each op's chunk says which (the data flow does not); so
            # its stages are known before it is simulated, and a split torch would refuse is not simulated
            stage = expand(self.search.stages(cuts))
            chunk = stage // p
            numbers = np.where(op_phases(graph) != PER_STEP, chunk * p + self.search.positions(s)[stage], -1)
            why = _unrunnable(graph, numbers, devices, s)
            if why is not None:
                return None, why
        try:
            r = simulate_schedule(graph, self.cluster, devices, s, chunk)
        except DevplaceError as exc:  # a class forced across the stage order: not a pipeline, skip it
            return None, str(exc)
        why = _unrunnable(graph, r.stage, r.device, s)
        return (None, why) if why is not None else (r, None)  # as torch's pipelining would refuse it

    def consider(self, s: Schedule, cuts: tuple[int, ...], rank: int) -> None:
        if (s, cuts) not in self.simulated:
            # a digest of the device per op: the graph as run has 10^4 ops, a search meets hundreds of splits
            # (under a V, of the stage per op: a cut moved across the turn keeps every op's device)
            per_op = self.search.stages(cuts) if s.kind in V_SHAPED else self.search.devices(cuts, s)
            key = (s, hashlib.blake2b(self.judged.expand(per_op).tobytes(), digest_size=16).digest())
            if key not in self.outcomes:
                r, why = self.simulate(s, cuts)
                self.outcomes[key] = why if r is None else _Outcome(r.step_time_s, r.feasible,
                                                                    float(sum(r.oom.values())))
                if r is not None and r.feasible:
                    self.results[s, cuts] = r
            got = self.outcomes[key]
            if isinstance(got, str) and self.refused is None:
                self.refused = got
            out = self.simulated[s, cuts] = got if isinstance(got, _Outcome) else None
            if out is not None and not out.feasible and (self.least_over is None
                                                         or out.over_bytes < self.least_over[0]):
                self.least_over = (out.over_bytes, s, cuts)
        out = self.simulated[s, cuts]
        if out is not None and out.feasible:
            key_ = (out.step_time_s, s.microbatches, rank)
            if self.best is None or key_ < self.best[:3]:
                self.best = (*key_, s, cuts)

    def plan(self) -> PipelinePlan | None:
        """The best feasible split as a plan (simulated again where an earlier run of the placer simulated it)."""
        if self.best is None:
            return None
        s, cuts = self.best[3], self.best[4]
        r = self.results.get((s, cuts)) or self.simulate(s, cuts)[0]
        assert r is not None
        return PipelinePlan(self.search.devices(cuts, s), s, r, cuts, self.search.stages(cuts))


def _check_settings(schedule: str, microbatches: int | None, chunks: int | None, cuts: str) -> None:
    _check_plan(schedule, microbatches, chunks, cuts, KINDS)


def _check_plan(schedule: str, microbatches: int | None, chunks: int | None, cuts: str,
                kinds: tuple[str, ...]) -> None:
    """PlacerError for settings the placer (`kinds`: `KINDS`) or `pipeline_plan` (`PLAN_KINDS`) does not take."""
    _check_kind(schedule, kinds)
    if cuts not in CUTS:
        raise PlacerError(f"placer 'pipeline': setting 'cuts' must be one of {', '.join(CUTS)}, got {cuts!r}")
    for name, value, high in (("microbatches", microbatches, MAX_MICROBATCHES), ("chunks", chunks, MAX_CHUNKS)):
        if value is not None:
            positive_int(value, name, "pipeline", high)


def _choices(schedule: str, devices: int) -> tuple[int, ...]:
    """The micro-batch counts the placer tries: `MICROBATCH_CHOICES`, except that interleaved-1f1b, which runs
    only multiples of the devices, tries those multiples of them up to the largest choice (on 3 devices 3, 6,
    12, 24, none of which the powers of 2 are; on 2 or 4 devices the same counts as before)."""
    if schedule != "interleaved-1f1b" or devices < 2:
        return MICROBATCH_CHOICES
    return tuple(devices * c for c in MICROBATCH_CHOICES if devices * c <= MICROBATCH_CHOICES[-1])


def _check_kind(schedule: str, kinds: tuple[str, ...]) -> None:
    if schedule not in kinds:
        raise PlacerError(f"placer 'pipeline': setting 'schedule' must be one of {', '.join(kinds)}, got {schedule!r}")


def pipeline_schedules(schedule: str, microbatches: int | None, chunks: int | None, devices: int, *,
                       batch: int | None = None, own: int | None = None,
                       kinds: tuple[str, ...] = KINDS) -> list[Schedule]:
    """The schedules the placer tries on `devices` devices for its settings (one per micro-batch count: the
    given one, else every one of the placer's choices (`_choices`) that divides `batch` and torch's pipelining
    runs on all `devices`: `Schedule.unrunnable`), or a PlacerError (a DevplaceError) for invalid settings;
    what `devplace place` checks before capturing a model.

    `batch`: the step's batch (None: unknown, every count allowed); `own`: M of a graph captured at the
    micro-batch size (`graph_microbatches`), the only count it runs under (`microbatch_graph=True`); `kinds` the
    schedules allowed (the placer's; `pipeline_plan` also cuts for the V-shaped ones, `PLAN_KINDS`)."""
    _check_kind(schedule, kinds)
    if microbatches is not None:
        microbatches = positive_int(microbatches, "microbatches", "pipeline")
    if own is not None:
        if microbatches not in (None, own):
            raise PlacerError(f"placer 'pipeline': the graph is one of {own} micro-batches of a step (captured at "
                              f"the micro-batch size), so it runs with microbatches={own}, not {microbatches}")
        counts: tuple[int, ...] = (own,)
    elif microbatches is None:
        counts = microbatch_counts(batch, _choices(schedule, devices))
        if not counts:  # none divides the batch: no pipeline of this step runs here, a no-fit placer auto skips
            why = (f"placer 'pipeline' on {devices} device(s): none of the micro-batch counts it tries under "
                   f"{schedule} ({', '.join(map(str, _choices(schedule, devices)))}) divides the batch of {batch}; "
                   "use a batch that one of them divides, --microbatches, or another schedule")
            raise unrunnable_error(why, why)
    else:
        if batch is not None and batch % microbatches:
            raise PlacerError(f"placer 'pipeline': microbatches={microbatches} does not split the batch of {batch} "
                              f"into equal micro-batches; with batch {batch} use one of {divisors_text(batch)}, or a "
                              f"batch that {microbatches} divides")
        counts = (microbatches,)
    if chunks is not None:
        chunks = positive_int(chunks, "chunks", "pipeline")
    try:
        schedules = [Schedule(schedule, m, chunks, microbatch_graph=own is not None) for m in counts]
    except ScheduleError as exc:  # e.g. chunks for a one-chunk schedule
        raise PlacerError(f"placer 'pipeline': {exc}") from None
    # only what torch's pipelining runs on all the devices (1f1b: M >= stages; interleaved: M a multiple of them)
    runnable = [s for s in schedules if s.unrunnable(devices) is None]
    if not runnable:
        if len({s.unrunnable(devices) for s in schedules}) == 1:  # one count, or a reason that is not the count
            why = f"placer 'pipeline' on {devices} device(s): {schedules[-1].unrunnable(devices)}"
        else:
            origin = f"that divide the batch of {batch}" if batch is not None else "it tries"
            why = (f"placer 'pipeline' on {devices} devices: {schedule} runs none of the micro-batch counts "
                   f"{origin} ({', '.join(str(m) for m in counts)}; at M={counts[-1]}: "
                   f"{schedules[-1].unrunnable(devices)}); use another schedule, or a batch and --microbatches "
                   "that it runs")
        if microbatches is not None:
            raise PlacerError(why)  # the count asked for is the problem
        # the step's batch is: no pipeline of it runs here, a candidate placer auto skips (and logs why)
        raise unrunnable_error(why, why)
    return runnable


Found = dict[Schedule, list[list[tuple[float, tuple[int, ...]]]]]  # per schedule, per way: (model step, cuts)


@dataclass(frozen=True, eq=False)
class StageSplits:
    """What the placer's dynamic program found (steps 1-4 of the module docstring), before anything is simulated:
    per order of the devices along the pipeline (`device_orders`) its `_Search` and, per schedule tried and way of
    counting transfers, the `CANDIDATES` best splits by the cost model. `split()` is the placer's answer, the
    cost model's best; `adjust()` is what the search runs after it (steps 5-6: the simulator judges the
    candidates and refines the best, Baechi's place -> adjust -> simulate)."""

    graph: CompGraph
    cluster: Cluster
    judged: FullGraph
    schedule: str
    cuts: str
    runs: tuple[tuple[_Search, list[Schedule], Found], ...]

    def split(self) -> tuple[np.ndarray, Schedule] | None:
        """The device per node and schedule of the split the cost model ranks first (of every device order,
        micro-batch count and way of counting transfers; ties: the first found); None when no split's memory
        bound fits."""
        best: tuple[float, _Search, Schedule, tuple[int, ...]] | None = None
        for search, schedules, found in self.runs:
            for s in schedules:
                for way in found[s]:
                    if way and (best is None or way[0][0] < best[0]):
                        best = (way[0][0], search, s, way[0][1])
        return None if best is None else (best[1].devices(best[3], best[2]), best[2])

    def adjust(self) -> PipelinePlan:
        """Steps 5-6 of the module docstring: the candidates simulated on the graph as run, the best refined under
        the simulator; the fastest plan of every device order. Raises NoFitError when none fits memory under the
        schedule (or none is a pipeline torch's pipelining runs)."""
        plans, refused = [], []
        for search, schedules, found in self.runs:
            plan = _judge_and_refine(self.judged, self.cluster, search, schedules, found)
            if isinstance(plan, PipelinePlan):
                plans.append(plan)
            elif plan is not None:
                refused.append(plan)
        if not plans:
            graph, cluster, schedule = self.graph, self.cluster, self.schedule
            only = " that begin where the export can cut (--set cuts=ops: anywhere)" if self.cuts == "modules" else ""
            if refused:  # not memory: every split judged is one torch's pipelining would not run
                raise unrunnable_error(
                    f"placer 'pipeline' found no {schedule} pipeline of {graph.name!r} on {cluster.name!r} that "
                    f"torch's pipelining runs: every split of the order into stages{only} that the search judged is "
                    f"refused ({refused[0]}); try another --order, --schedule or --microbatches, or --set cuts=ops",
                    f"no split of the order into {schedule} stages{only} is a pipeline torch runs ({refused[0]})")
            raise no_fit_error(graph, cluster, "pipeline", f"no split of the order into {schedule} pipeline "
                               f"stages{only} fits memory under the schedule")
        return min(plans, key=lambda pl: (pl.step_time_s, pl.schedule.microbatches))  # of equals the first order's


def stage_splits(graph: CompGraph, cluster: Cluster, order: np.ndarray, *, schedule: str = "1f1b",
                 microbatches: int | None = None, chunks: int | None = None, cuts: str = "modules",
                 ties: np.ndarray | None = None, as_run: FullGraph | None = None) -> StageSplits:
    """Steps 1-4 of the module docstring: the items, the memory table and the dynamic program's candidate splits
    for every device order and micro-batch count, nothing simulated (arguments as `pipeline_plan`'s).
    Raises PlacerError (a DevplaceError) for invalid settings, NoFitError where no schedule can run."""
    _check_plan(schedule, microbatches, chunks, cuts, PLAN_KINDS)
    schedules = pipeline_schedules(schedule, microbatches, chunks, cluster.num_devices, batch=graph_batch(graph),
                                   own=graph_microbatches(graph), kinds=PLAN_KINDS)
    classes = tie_classes(graph) if ties is None else np.asarray(ties, dtype=np.int64)
    # the same for every device order
    times = op_times(graph, cluster)
    items = _items(graph, order, classes, times, step_times(graph, cluster), cuts)
    judged = as_run if as_run is not None else FullGraph.same(graph)
    # the item of each node of the graph as run: expanding gathers a value per node of `graph` (its item)
    memory = StageMemory(judged.graph, judged.expand(items.owner), items.blocked, cluster)
    stages = cluster.num_devices * max(int(s.chunks or 1) for s in schedules)
    places = int((~items.blocked[1:-1]).sum())  # where a stage may end inside the sequence
    where = " (where a module call begins, as the export cuts; --set cuts=ops: anywhere)" if cuts == "modules" else ""
    if stages > cluster.num_devices and places < stages - 1:  # interleaved: every stage holds ops
        raise unrunnable_error(
            f"placer 'pipeline': {schedule} runs {stages} stages on {cluster.name!r}, but the order of "
            f"{graph.name!r} has only {places} place(s) where a stage may end{where}, "
            f"so at most {places + 1} stages; use fewer chunks (--set chunks=...), fewer devices, or --schedule 1f1b",
            f"{stages} {schedule} stages, but only {places} place(s) where a stage may end")
    # interleaved: no stage left empty (torch's pipelining runs all V chunks of every device), so each chunk's
    # micro-batches in flight are the schedule's
    full = any(int(s.chunks or 1) > 1 for s in schedules)
    runs = []
    for device_order in device_orders(graph, cluster, times):
        identity = device_order == tuple(range(cluster.num_devices))
        ordered = [s if identity else replace(s, device_order=device_order) for s in schedules]
        search = _Search(graph, cluster, items, memory, device_order)
        found = {s: [search.splits(s, waits, CANDIDATES, full) for waits in (False, True)] for s in ordered}
        runs.append((search, ordered, found))
    return StageSplits(graph, cluster, judged, schedule, cuts, tuple(runs))


def pipeline_plan(graph: CompGraph, cluster: Cluster, order: np.ndarray, *, schedule: str = "1f1b",
                  microbatches: int | None = None, chunks: int | None = None, cuts: str = "modules",
                  ties: np.ndarray | None = None, as_run: FullGraph | None = None) -> PipelinePlan:
    """The best pipeline placement of `graph` found by the search of the module docstring, with its schedule: the
    dynamic program's candidates (`stage_splits`) judged and refined by the simulator (`StageSplits.adjust`).

    `order` is the traversal as node indices; `ties` a tie class per node, each kept on one device (None:
    `devplace.graph.ties.tie_classes(graph)`); `cuts` where stages may begin (module docstring, step 2);
    `as_run` the graph that runs (a device per node of `graph` expands to one per node of it; None: `graph`
    itself), which the memory bound is taken on and every split is simulated on. The plan's `devices` are
    `graph`'s, its `result` the simulation of the graph as run. Beside the placer's schedules, `schedule` may be
    zbv or dualpipev (`PLAN_KINDS`): 2p stages, stage k on position k and 2p - 1 - k on the way back, cut by the
    same dynamic program on that map; which of a device's two stages each op is in is the plan's `stage`, which
    a placement does not record (a `ParallelPlan`'s stages carry it).
    Raises NoFitError when no split fits memory under the schedule, PlacerError (a DevplaceError) for invalid
    settings."""
    return stage_splits(graph, cluster, order, schedule=schedule, microbatches=microbatches, chunks=chunks,
                        cuts=cuts, ties=ties, as_run=as_run).adjust()


def _judge_and_refine(judged: FullGraph, cluster: Cluster, search: _Search, schedules: list[Schedule],
                      found: Found) -> PipelinePlan | str | None:
    """Steps 5-6 of the module docstring for one order of the devices along the pipeline (`search.perm`) and its
    candidates `found`: the best split, judged and refined; else why the splits judged are no pipeline torch
    runs, when every one of them is refused so (none was judged on memory); else None (none fits memory)."""
    judge = _Judge(judged, cluster, search)
    # each way's leading split for every M, then the others for the M that did best
    for s in schedules:
        for way in found[s]:
            if way:
                judge.consider(s, way[0][1], 0)
    s_next = judge.best[3] if judge.best is not None else None
    for s in [s_next] if s_next is not None else schedules:
        for way in found[s]:
            for rank, (_, cuts) in enumerate(way[1:], start=1):
                judge.consider(s, cuts, rank)
    if judge.best is None and judge.least_over is None:
        return judge.refused
    return _refine(judge)


def _refine(judge: _Judge) -> PipelinePlan | None:
    """Pattern search on the cut points of the judged best split (where none is within memory: of the one least
    over it), the simulator judging each move: move one cut at a time by `step` places either way (a stage may
    become empty), keeping a move that shortens the simulated step within memory (while none is within memory:
    one that brings the split within memory or less over it); when none does, every cut inside the sequence
    together (the first stage grows and the last shrinks, or back: the middle stages keep their size, which no
    one-cut move does; bert-base's interleaved pipeline on 4 V100s found 1.6% faster so); when that does not
    either, halve `step`; at most `REFINE_SIMULATIONS` simulations, of which `FIT_SIMULATIONS` while no split
    tried is within memory (a split far over memory is not worth a long walk: gpt2-xl's interleaved M=4 spent
    22.7 s walking to no fit).
    The places are the items' `stops` (every item boundary; on a captured model, the boundaries between
    segments only, so that a step moves a cut by whole segments). The cost model ranks splits only approximately
    (transfers and the schedule's waits are estimated), so the best split it finds is often a few items off
    the simulator's best. The dynamic program's memory is a lower bound, so its splits can be over memory
    as run; this search moves their cuts until they are not. None when no split it tried fits."""
    if judge.best is not None:
        s, cuts = judge.best[3], judge.best[4]
    else:
        assert judge.least_over is not None
        _, s, cuts = judge.least_over
    stops = judge.search.items.stops
    blocked = judge.search.items.blocked
    at = {int(x): j for j, x in enumerate(stops.tolist())}
    end = cuts[-1]
    step = max(1, (stops.shape[0] - 1) // (4 * len(cuts)))

    def moved_by(cut: int, by: int) -> int:
        j = at[cut] + by
        return int(stops[j]) if 0 <= j < stops.shape[0] else -1

    spent = 0

    def score() -> tuple[int, float]:
        """The best split's step within memory, else how far the least-over split is over memory."""
        if judge.best is not None:
            return (0, judge.best[0])
        assert judge.least_over is not None
        return (1, judge.least_over[0])

    def better(trial: tuple[int, ...]) -> bool:
        """Simulate `trial` (a split not seen yet, every inner cut where a stage may end): True when it is
        the best so far."""
        nonlocal spent
        if (any(c < 0 or (0 < c < end and blocked[c]) for c in trial)
                or any(a > b for a, b in itertools.pairwise(trial)) or (s, trial) in judge.simulated):
            return False
        if judge.best is not None and judge.search.over_memory(trial, s):
            return False  # over memory by the stage bound, so as run too: it cannot become the best
        before = score()
        judge.consider(s, trial, CANDIDATES)
        spent += 1
        return score() < before

    def budget() -> bool:
        return spent < (REFINE_SIMULATIONS if judge.best is not None else FIT_SIMULATIONS)

    while step >= 1 and budget():
        moved = False
        for k in range(len(cuts) - 1):  # one cut either way; the last cut is the end of the sequence
            for by in (step, -step):
                trial = (*cuts[:k], moved_by(cuts[k], by), *cuts[k + 1:])
                if better(trial):
                    cuts, moved = trial, True
                    break
            if not budget():
                break
        for by in (step, -step) if not moved and budget() else ():  # every inner cut together
            trial = tuple(moved_by(c, by) if 0 < c < end else c for c in cuts)
            if better(trial):
                cuts, moved = trial, True
                break
        if not moved:
            step //= 2
    return judge.plan()


def _order_key(graph: CompGraph, visit: np.ndarray, settings: Mapping[str, Any]) -> bytes:
    """What of the order `visit` the placer's result depends on: the items' sequence (`_items`); with
    `cuts="modules"` (the default) only up to the order within each run of one segment's ops (between module
    starts), where no stage can end (every sum, maximum and crossing the search uses is over whole runs), so
    orders that differ only inside segments are one candidate."""
    if settings.get("cuts", "modules") != "modules":
        return forward_sequence(graph, visit).tobytes()
    segment = graph.derived("segment_spans", segment_spans)[:, 0]
    seq = forward_sequence(graph, visit, segment)
    seg = segment[seq]
    starts = np.ones(seq.shape[0], dtype=bool)  # a new run: another segment, or an op of none
    starts[1:] = (seg[1:] != seg[:-1]) | (seg[1:] < 0)
    return seq[np.lexsort((seq, np.cumsum(starts)))].tobytes()


@register("pipeline", uses_order=True, cheap=True, check=_check_settings, order_key=_order_key)
def pipeline(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int, ties: np.ndarray | None = None,
             as_run: FullGraph | None = None, schedule: str = "1f1b", microbatches: int | None = None,
             chunks: int | None = None, cuts: str = "modules") -> PlacerOutput:
    """Pipeline stages: cut the traversal order into contiguous stages (one per device, or `chunks` per device
    for interleaved-1f1b) minimising a pipeline cost model under a memory lower bound, choosing the micro-batch
    count; with the step that adjusts that split under the simulator, which the search runs after it.

    Uses the traversal order. Settings: `schedule` (gpipe, 1f1b, interleaved-1f1b), `microbatches` (None:
    the best of 1-32), `chunks` (None: 1, or 2 for interleaved), `cuts` (modules: a captured model's stages
    begin only where its pipeline export can cut; ops: anywhere). The placer is the dynamic program over cut
    points (steps 1-4 of the module docstring, `stage_splits`): it returns the split its cost model ranks first,
    unsimulated, with `adjust` (`StageSplits.adjust`, steps 5-6: the simulator judges the dynamic program's
    candidates on the graph as run and refines the best), which the search runs before it judges the answer
    (Baechi's place -> adjust -> simulate), so that `devplace place --placer pipeline` answers the adjusted
    split. Keeps every tie class on one device; returns the devices with the chosen schedule, which the
    placement carries (`Placement.schedule`) and the search judges the step under.
    """
    _check_settings(schedule, microbatches, chunks, cuts)  # its placements run without a stage per op: no V
    splits = stage_splits(graph, cluster, order, schedule=schedule, microbatches=microbatches, chunks=chunks,
                          cuts=cuts, ties=ties, as_run=as_run)

    def adjust() -> PlacerOutput:
        plan = splits.adjust()
        return PlacerOutput(plan.devices, plan.schedule)
    first = splits.split()
    if first is None:  # no split's memory bound fits: adjust raises the placer's NoFitError
        return adjust()
    return PlacerOutput(first[0], first[1], adjust=adjust)
