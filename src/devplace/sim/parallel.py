"""Simulation of a dp x pp `ParallelPlan` (DESIGN.md section 9b): one replica's pipelined step, gradient
synchronisation overlapping the backward in buckets, ZeRO's traffic, recomputation, and memory per device by
category.

`simulate_parallel(graph, cluster, stage, plan)`:

1. `graph` is one replica's step (captured at batch / dp; forward and backward scaled by 1/M, as
   `simulate_schedule` does) or one micro-batch of it (captured at batch / dp / M, meta "microbatches" = M:
   exact). `stage[v]` is the pipeline stage of op v; replica r runs stage s on `plan.replica(r)[s]`.
2. Stages that recompute get a copy of their forward ops, of kind "backward", that reads what the original
   read and feeds the stage's backward ops instead of the original (`recompute_graph`), unit by unit: each
   numbered block (transformer layer) of the stage is a checkpoint (`recompute_units`), as Megatron-LM's full
   recomputation and torch's per-layer activation checkpointing run it. The stage then keeps only each
   block's input per micro-batch, and reruns a block's forward when its backward begins, on the critical
   path. A stage that recomputes k blocks reruns only its first k (`recomputed_units`, Megatron-LM's
   "block" method with k layers); its other ops keep their activations as without recomputation.
3. Each replica's pipeline is simulated with the reference model (`simulate_schedule`; replicas on devices of
   the same speeds, memory and links are simulated once).
4. Gradients of a parameter are complete when the last backward op feeding its update has finished (for a
   parameter held by a forward op, at the end of its stage's backward). They are packed, in that order, into
   buckets of `bucket_bytes` (DDP's 25 MB); each bucket is reduced over the stage's data-parallel group as
   soon as it is complete and the previous one is done (`collective_s` on the links the group uses):
   all-reduce under ZeRO-0, reduce-scatter under ZeRO 1-3. The stage's optimizer update waits for the last
   bucket, so the sync is on the step's critical path only where it outlasts the backward. Under ZeRO 1-3
   the update runs on 1/dp of the parameters; under ZeRO 1-2 the updated shards are all-gathered after it.
   Under ZeRO-3 every forward and backward of a micro-batch first all-gathers the stage's parameters
   (2 M all-gathers per step, prefetched while the stage computes): the first unit's (one bucket) gather,
   before any compute, and the part of the rest that the stage's busy time does not cover are added to its
   end.
5. Memory per device, by category (`MemoryBreakdown`): parameters, gradients and optimizer state are the
   stage's persistent bytes split by `param_shares` and divided by dp as the ZeRO stage shards them (and so
   are, under ZeRO 1-3, the optimizer update's outputs and scratch: `sharded_updates`);
   activations ("stash") and temporaries are the simulated live bytes at the device's peak (forward outputs
   kept or received; the rest: op scratch space, gradients in flight), plus, under ZeRO-3, one bucket of
   gathered parameters. With dp = 1, ZeRO-0 and no recomputation the total is the reference model's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numba import njit

from devplace.graph.batch import graph_batch, graph_microbatches
from devplace.graph.compgraph import CompGraph
from devplace.graph.modules import numbered_block
from devplace.graph.parallel import V_SHAPED, ParallelPlan, ParallelPlanError
from devplace.graph.phases import (
    ACCUMULATE_BY_KIND_KEY,
    ACCUMULATE_BYTES_KEY,
    ACCUMULATE_KEY,
    ACCUMULATES_KEY,
    SCALE_BY_KIND_KEY,
    SCALE_KEY,
    STEP_COMPUTE_BY_KIND_KEY,
    STEP_COMPUTE_KEY,
    accumulation_extended,
    step_compute,
    step_compute_extended,
)
from devplace.graph.ties import tie_classes, tie_classes_extended
from devplace.hardware.cluster import Cluster, step_times
from devplace.hardware.collectives import collective_s
from devplace.sim.schedule import BACKWARD, FORWARD, PER_STEP, ScheduledResult, op_phases, simulate_schedule

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb=25
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "none": 0}  # states per parameter element
RECOMPUTE_SUFFIX = "#recompute"  # id of a recomputed forward op: the original's id + this
CATEGORIES = ("parameters", "gradients", "optimizer_state", "stash", "temporaries")


# --------------------------------------------------------------------------- persistent bytes by category


@dataclass(frozen=True)
class ParamShares:
    """Which fraction of a graph's `param_bytes` is weights (and buffers), gradients and optimizer state
    (master weights included)."""

    parameters: float
    gradients: float
    optimizer_state: float


def param_shares(graph: CompGraph) -> ParamShares:
    """The split of `param_bytes` (weights + gradient + optimizer state, DESIGN section 3) by what a capture
    records in meta["capture"]: the optimizer's states per element (Adam 2, SGD 0), the fp32 master copies
    (`master_weight_bytes`, whose optimizer state is fp32 too) and the buffers (counted as parameters).
    A graph that records no capture is taken as Adam without master copies: 1/4, 1/4, 1/2."""
    cap = graph.meta.get("capture")
    cap = cap if isinstance(cap, dict) else {}
    total = _bytes(cap.get("param_bytes"))
    states = OPTIMIZER_STATES.get(str(cap.get("optimizer")))
    if total is None or states is None:
        return ParamShares(0.25, 0.25, 0.5)
    buffers = _bytes(cap.get("buffer_bytes")) or 0.0
    master = _bytes(cap.get("master_weight_bytes")) or 0.0
    optimizer = master * (1 + states) if master else 0.0
    weights = (total - optimizer) / (2 + (0 if master else states))
    if not master:
        optimizer = states * weights
    whole = total + buffers
    if weights < 0 or whole <= 0:
        return ParamShares(0.25, 0.25, 0.5)
    return ParamShares((weights + buffers) / whole, weights / whole, optimizer / whole)


def _bytes(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


# --------------------------------------------------------------------------- recomputation


def op_blocks(graph: CompGraph) -> np.ndarray:
    """int64[V]: each op's numbered block (a transformer layer: `numbered_block` of the forward op's id or group),
    numbered 0, 1, ... in the program's order, -1 for an op of none (embeddings, head); a backward op in its tie
    class's block."""
    phase = op_phases(graph)
    classes = tie_classes(graph)
    index: dict[tuple[str, int], int] = {}
    class_block: dict[int, int] = {}
    for v in np.flatnonzero(phase == FORWARD).tolist():  # node order: the program's, blocks numbered as run
        found = numbered_block(graph.group[v]) or numbered_block(graph.ids[v])
        if found:
            class_block.setdefault(int(classes[v]), index.setdefault(found, len(index)))
    return np.array([class_block.get(int(c), -1) for c in classes.tolist()], dtype=np.int64)


def recompute_units(graph: CompGraph, stage: np.ndarray, blocks: np.ndarray | None = None) -> np.ndarray:
    """int64[V]: each op's recomputation unit, a checkpoint of activation checkpointing: the ops of one
    numbered block (`op_blocks`, or `blocks` where given) on one stage, the stage's other ops (embeddings,
    head) as one more unit. On a graph without numbered blocks, each stage is one unit."""
    block = op_blocks(graph) if blocks is None else blocks
    return np.asarray(stage, dtype=np.int64) * (int(block.max(initial=-1)) + 2) + block + 1


def stage_blocks(blocks: np.ndarray, pos: np.ndarray, pp: int) -> tuple[np.ndarray, ...]:
    """Per device position s < pp, the numbered blocks (`op_blocks`) of its ops, in the program's order: what
    a recomputation of k blocks takes the first k of."""
    return tuple(np.unique(blocks[(pos == s) & (blocks >= 0)]) for s in range(pp))


def recomputed_units(plan: ParallelPlan, units: np.ndarray, blocks: np.ndarray, pos: np.ndarray,
                     held: tuple[np.ndarray, ...]) -> tuple[int, ...]:
    """The recomputation units `plan` reruns: every unit of a stage that recomputes "full" (or all its blocks),
    the units of the first k blocks of a stage that recomputes k; `held` is each position's blocks
    (`stage_blocks(blocks, pos, plan.pp)`)."""
    chosen: set[int] = set()
    for s, (r, mine) in enumerate(zip(plan.recompute, held, strict=True)):
        at = pos == s
        if r == "full" or (isinstance(r, int) and r >= mine.size):
            chosen.update(np.unique(units[at]).tolist())
        elif isinstance(r, int):
            chosen.update(np.unique(units[at & np.isin(blocks, mine[:r])]).tolist())
    return tuple(sorted(chosen))


def recompute_graph(graph: CompGraph, stage: np.ndarray, stages: tuple[int, ...]) -> CompGraph:
    """`graph` with the forward ops of `stages` recomputed before their backward (module docstring, step 2).
    `stage` groups the ops into units rerun as one (pipeline stages, or the blocks of `recompute_units`;
    "stage" below). Every forward op of a chosen stage but the graph's inputs (op "input": kept; a source that
    computes from parameters or constants alone, such as autocast's cast of a weight, is rerun like the rest)
    that leads to an op the stage's backward reads gets a copy "<id>#recompute" of kind "backward" (tied to the
    original, no parameters, no once-per-step compute) that reads what the original reads (the copy of an op
    copied in the same stage; another stage's output as kept or received) and feeds the stage's backward ops
    in its place. The first copies also read the gradients the stage's backward receives from other stages
    (those that do not depend on the copies), so that the rerun waits for the backward to begin, on its
    critical path."""
    phase = op_phases(graph)
    chosen = np.isin(stage, np.asarray(stages, dtype=np.int64))
    src, dst = graph.edge_src, graph.edge_dst
    # copied: forward ops of a chosen stage that are ancestors (within the stage's forward) of an op that a
    # backward op of the stage reads
    copied = np.zeros(graph.num_nodes, dtype=bool)
    has_pred = np.bincount(dst, minlength=graph.num_nodes) > 0
    feeds_bwd = (phase[src] == FORWARD) & (phase[dst] == BACKWARD) & (stage[src] == stage[dst]) & chosen[src]
    copied[src[feeds_bwd]] = True
    _copy_ancestors(graph.topo_order, graph.succ_ptr, graph.succ_edges, dst, phase, chosen, np.asarray(stage),
                    copied)
    # a source other than the graph's inputs is computed from parameters or constants alone (under autocast, a
    # weight's fp16 cast): activation checkpointing reruns it with the rest, rather than keep it per micro-batch
    is_input = np.array([op == "input" for op in graph.op], dtype=bool)
    copied &= (has_pred | ~is_input) & (phase == FORWARD)
    if not copied.any():
        return graph
    step = step_compute(graph)
    # built as columns (`CompGraph.from_arrays`, the graph `build` makes of the same records): the records of a
    # captured step took up to 3 s per recomputed graph on a loaded machine, most of a parallel plan's simulation
    clones = np.flatnonzero(copied)
    n = graph.num_nodes
    clone_at = np.full(n, -1, dtype=np.int64)
    clone_at[clones] = n + np.arange(clones.size)
    # every edge in edge order, a copied op's backward readers reading its copy, and right after an edge into a
    # copied op the same edge into its copy (the copy reads what the original reads: the copy of a producer
    # copied in its stage); as columns, then lists for the edges added below
    to_copy = copied[src] & (phase[dst] == BACKWARD) & (stage[dst] == stage[src])
    again = copied[dst]
    own = copied[src] & (stage[src] == stage[dst])
    at = np.arange(graph.num_edges) + np.cumsum(again) - again  # each edge's place, after the copies' before it
    carried = np.empty(graph.num_edges + int(again.sum()), dtype=np.int64)  # the edge each one carries what of
    carried[at] = np.arange(graph.num_edges)
    carried[at[again] + 1] = np.flatnonzero(again)
    ends = np.empty((2, carried.size), dtype=np.int64)
    ends[:, at] = np.where(to_copy, clone_at[src], src), dst
    ends[:, at[again] + 1] = np.where(own, clone_at[src], src)[again], clone_at[dst[again]]
    e_src: list[int] = ends[0].tolist()
    e_dst: list[int] = ends[1].tolist()
    e_bytes: list[float] = graph.edge_bytes[carried].tolist()
    e_tensor: list[int] = graph.edge_tensor[carried].tolist()
    e_extra: list[dict[str, Any]] = ([graph.edge_extra[e] for e in carried.tolist()] if graph.edge_extra
                                     else [{} for _ in range(carried.size)])

    def edge(u: int, w: int, like: int | None, nbytes: float = 0.0, tensor: int = 0) -> None:
        """An edge u -> w carrying what edge `like` carries (None: `nbytes` of `tensor`, no extra keys)."""
        e_src.append(u)
        e_dst.append(w)
        e_bytes.append(float(graph.edge_bytes[like]) if like is not None else nbytes)
        e_tensor.append(int(graph.edge_tensor[like]) if like is not None else tensor)
        e_extra.append(graph.edge_extra[like] if like is not None and graph.edge_extra else {})
    # the rerun starts when the backward does: each first copy also waits for the gradients the stage's
    # backward receives from other stages (the same tensors, so no transfer more) -- those that do not
    # themselves wait for the copies (a coarse backward group may feed a later stage's backward)
    incoming: dict[int, list[int]] = {}
    for e in np.flatnonzero((phase[src] == BACKWARD) & (phase[dst] == BACKWARD) & (stage[src] != stage[dst])
                            & chosen[dst]).tolist():
        incoming.setdefault(int(stage[dst[e]]), []).append(e)
    first = [v for v in clones.tolist() if not any(copied[u] and stage[u] == stage[v] for u in graph.predecessors(v))]
    after: dict[int, np.ndarray] = {}
    for v in first:
        s = int(stage[v])
        if s not in after:
            after[s] = _descendants(graph, np.flatnonzero(_reads_copies(graph, copied, phase, stage, s)))
        seen = set()
        for e in incoming.get(s, []):
            key = (int(src[e]), int(graph.edge_tensor[e]))
            if key not in seen and not after[s][src[e]]:
                seen.add(key)
                edge(int(src[e]), int(clone_at[v]), e)
        if not seen and not has_pred[v]:
            # a source's copy with no gradient to wait for (the stage whose backward begins the step's: the
            # loss's) would run at once and hold its output through the forward: it waits for the end of the
            # stage's forward (its ops that feed no forward op), on 0-byte control edges
            for u in _forward_ends(graph, phase, stage, s):
                edge(u, int(clone_at[v]), None, 0.0, int(graph.edge_tensor[graph.out_edges(u)].max(initial=-1)) + 1)
    # a copy runs no once-per-step compute and makes no parameter gradient (a coarse group's backward part does)
    dropped = (STEP_COMPUTE_KEY, STEP_COMPUTE_BY_KIND_KEY, ACCUMULATES_KEY, ACCUMULATE_KEY, ACCUMULATE_BY_KIND_KEY,
               ACCUMULATE_BYTES_KEY, SCALE_KEY, SCALE_BY_KIND_KEY)
    extra = graph.node_extra or tuple({} for _ in range(n))
    return CompGraph.from_arrays(
        graph.name, [*graph.ids, *(graph.ids[v] + RECOMPUTE_SUFFIX for v in clones.tolist())],
        [*graph.op, *(graph.op[v] for v in clones.tolist())], [*graph.kind, *(["backward"] * clones.size)],
        [*graph.group, *(graph.ids[v] for v in clones.tolist())],
        np.concatenate([graph.compute_s, graph.compute_s[clones] - step.compute_s[clones]]),
        np.concatenate([graph.output_bytes, graph.output_bytes[clones]]),
        np.concatenate([graph.param_bytes, np.zeros(clones.size)]),
        np.concatenate([graph.temp_bytes, graph.temp_bytes[clones]]),
        np.asarray(e_src, dtype=np.int64), np.asarray(e_dst, dtype=np.int64), np.asarray(e_bytes),
        np.asarray(e_tensor, dtype=np.int64), meta=graph.meta,
        kind_compute={k: np.concatenate([col, col[clones] - step.by_kind[k][clones]])
                      for k, col in graph.kind_compute.items()},
        node_extra=[*extra, *({k: x for k, x in extra[v].items() if k not in dropped} for v in clones.tolist())],
        edge_extra=e_extra)


def sharded_updates(graph: CompGraph, stage: np.ndarray, plan: ParallelPlan) -> CompGraph:
    """`graph` with the output and scratch bytes of the once-per-step ops (the optimizer's update) of the stages
    whose ZeRO stage is 1-3 divided by dp (module docstring, 5): each replica updates its 1/dp shard of the
    parameters, so Adam's per-parameter temporaries (the sqrt and div of its second moment) are a shard's too.
    Their time is sharded by `_stage_sync`, not here. `stage[v]` is op v's device position."""
    shard = (op_phases(graph) == PER_STEP) & (np.asarray(plan.zero)[stage] >= 1)
    if plan.dp == 1 or not shard.any():
        return graph
    scale = np.where(shard, 1.0 / plan.dp, 1.0)
    sharded = CompGraph.from_arrays(
        graph.name, graph.ids, graph.op, graph.kind, graph.group, graph.compute_s, graph.output_bytes * scale,
        graph.param_bytes, graph.temp_bytes * scale, graph.edge_src, graph.edge_dst,
        graph.edge_bytes * scale[graph.edge_src], graph.edge_tensor, meta=graph.meta, kind_compute=graph.kind_compute,
        node_extra=graph.node_extra, edge_extra=graph.edge_extra)
    tie_classes_extended(sharded, graph)  # the same nodes, records and compute: the graph's classes and step parts
    step_compute_extended(sharded, graph)
    accumulation_extended(sharded, graph)
    return sharded


def _forward_ends(graph: CompGraph, phase: np.ndarray, stage: np.ndarray, s: int) -> list[int]:
    """The forward ops of stage s that feed no forward op (the loss, outputs read only by the backward)."""
    src, dst = graph.edge_src, graph.edge_dst
    feeds = np.zeros(graph.num_nodes, dtype=bool)
    feeds[src[phase[dst] == FORWARD]] = True
    return np.flatnonzero((phase == FORWARD) & (stage == s) & ~feeds).tolist()


def _reads_copies(graph: CompGraph, copied: np.ndarray, phase: np.ndarray, stage: np.ndarray, s: int) -> np.ndarray:
    """bool[V]: the backward ops of stage s that read a copied op (and so will read its copy)."""
    src, dst = graph.edge_src, graph.edge_dst
    out = np.zeros(graph.num_nodes, dtype=bool)
    out[dst[copied[src] & (phase[dst] == BACKWARD) & (stage[dst] == s) & (stage[src] == s)]] = True
    return out


def _descendants(graph: CompGraph, starts: np.ndarray) -> np.ndarray:
    """bool[V]: `starts` and every op reachable from them."""
    reached = np.zeros(graph.num_nodes, dtype=bool)
    reached[starts] = True
    _reach(graph.topo_order, graph.succ_ptr, graph.succ_edges, graph.edge_dst, reached)
    return reached


@njit(cache=True)
def _reach(topo, succ_ptr, succ_edges, dst, reached):  # pragma: no cover - compiled
    """Mark in `reached` every op reachable from those marked (a walk in topological order `topo`)."""
    for v in topo:
        if reached[v]:
            for x in range(succ_ptr[v], succ_ptr[v + 1]):
                reached[dst[succ_edges[x]]] = True


@njit(cache=True)
def _copy_ancestors(topo, succ_ptr, succ_edges, dst, phase, chosen, stage, copied):  # pragma: no cover - compiled
    """`recompute_graph`'s copies, in `copied`: also every forward op of a chosen stage with a forward successor of
    its own stage that is copied (successors first: reversed topological order `topo`)."""
    for i in range(topo.shape[0] - 1, -1, -1):
        v = topo[i]
        if copied[v] or phase[v] != FORWARD or not chosen[v]:
            continue
        for x in range(succ_ptr[v], succ_ptr[v + 1]):
            w = dst[succ_edges[x]]
            if copied[w] and stage[w] == stage[v] and phase[w] == FORWARD:
                copied[v] = True
                break


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class MemoryBreakdown:
    """One device's memory at its peak, by category (bytes)."""

    device: int
    stage: int
    parameters: float
    gradients: float
    optimizer_state: float
    stash: float
    temporaries: float
    capacity: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.stash + self.temporaries

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the categories, their total and the device's capacity."""
        return {"device": self.device, "stage": self.stage, **{c: getattr(self, c) for c in CATEGORIES},
                "total": self.total, "capacity": self.capacity}


@dataclass(frozen=True)
class StageSync:
    """Stage s's data-parallel synchronisation: when its backward ended and its gradient sync ended (on the
    slowest replica), the seconds its collectives took in all, and when the stage's step ends."""

    stage: int
    group: tuple[int, ...]
    backward_end_s: float
    sync_end_s: float
    comm_s: float
    end_s: float


@dataclass(frozen=True, eq=False)
class ParallelResult:
    """A simulated dp x pp step: its time, the replicas' pipeline simulations (`pipelines[r]`, made on the
    devices `simulated_on[r]`: those of the first replica alike, whose result replica r shares), each stage's
    sync and each device's memory by category; `run_graph` is the graph the pipelines ran (with the recomputed
    forward ops of `recompute_graph` where the plan recomputes), what their per-op results index."""

    plan: ParallelPlan
    step_time_s: float
    pipelines: tuple[ScheduledResult, ...]
    simulated_on: tuple[tuple[int, ...], ...]
    sync: tuple[StageSync, ...]
    memory: tuple[MemoryBreakdown, ...]
    run_graph: CompGraph

    @property
    def feasible(self) -> bool:
        return all(m.fits for m in self.memory)

    def as_sim_result(self) -> ScheduledResult:
        """The plan as one simulation result, for a report's table: replica 0's pipeline (each op's times, its
        schedule, its transfers: the collectives are in `sync`) with the plan's step time, each device's peak
        its memory total by category (`memory`) and each device's busy time in its own replica's pipeline."""
        first = self.pipelines[0]
        peak, busy = first.peak_memory_bytes.copy(), first.device_busy_s.copy()
        for m in self.memory:
            peak[m.device] = m.total
        for r, (pipeline, on) in enumerate(zip(self.pipelines, self.simulated_on, strict=True)):
            for s, device in enumerate(self.plan.replica(r)):
                busy[device] = pipeline.device_busy_s[on[s]]
        return replace(first, step_time_s=self.step_time_s, peak_memory_bytes=peak, device_busy_s=busy)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the plan under "parallel", step time, feasibility, per-stage sync, memory per device."""
        return {"parallel": self.plan.to_dict(), "step_time_s": self.step_time_s, "feasible": self.feasible,
                "pipeline_step_time_s": max(p.step_time_s for p in self.pipelines),
                "sync": [{"stage": s.stage, "group": list(s.group), "backward_end_s": s.backward_end_s,
                          "sync_end_s": s.sync_end_s, "comm_s": s.comm_s, "end_s": s.end_s} for s in self.sync],
                "memory": [m.to_dict() for m in self.memory]}


# --------------------------------------------------------------------------- simulation


def simulate_parallel(graph: CompGraph, cluster: Cluster, stage: np.ndarray, plan: ParallelPlan, *,
                      bucket_bytes: float = DDP_BUCKET_BYTES) -> ParallelResult:
    """Simulate one step of `plan` (module docstring); `stage[v]` is op v's pipeline stage: 0..pp-1, or, for
    a schedule of V chunks per device, 0..V*pp-1 in the order data flows (`stage_layout` says where each
    runs). The plan's per-stage choices (ZeRO, recomputation) and its stage groups are per device position."""
    stage = _check(graph, cluster, stage, plan, bucket_bytes)
    own = graph_microbatches(graph)
    pos, chunk = stage_layout(plan, stage)
    blocks = op_blocks(graph)
    held = stage_blocks(blocks, pos, plan.pp)
    plan.check_blocks(tuple(b.size for b in held))
    units = recompute_units(graph, stage, blocks)
    chosen = recomputed_units(plan, units, blocks, pos, held)
    run_graph = recompute_graph(graph, units, chosen) if chosen else graph
    originals = [graph.index[i.removesuffix(RECOMPUTE_SUFFIX)] for i in run_graph.ids[graph.num_nodes:]]
    run_stage = np.concatenate([pos, pos[originals]])
    run_graph = sharded_updates(run_graph, run_stage, plan)
    run_chunk = np.concatenate([chunk, chunk[originals]])
    pipelines: list[ScheduledResult] = []
    simulated_on: list[tuple[int, ...]] = []
    seen: dict[bytes, tuple[ScheduledResult, tuple[int, ...]]] = {}
    for r in range(plan.dp):
        devs = np.asarray(plan.replica(r), dtype=np.int64)
        key = _signature(cluster, devs)
        if key not in seen:
            seen[key] = (simulate_schedule(run_graph, cluster, devs[run_stage],
                                           plan.pipeline_schedule(r, microbatch_graph=own is not None),
                                           run_chunk if (plan.chunks or 1) > 1 else None),
                         plan.replica(r))
        pipelines.append(seen[key][0])
        simulated_on.append(seen[key][1])
    shares = param_shares(graph)
    phase = op_phases(run_graph)
    sync: list[StageSync] = []
    memory: list[MemoryBreakdown] = []
    per_step = step_times(run_graph, cluster)
    for s in range(plan.pp):
        members = run_stage == s
        # with the copies of tied parameters the stage's device holds (the simulated pipeline has them)
        persistent = float(run_graph.param_bytes[members].sum()) + float(pipelines[0].copy_bytes[simulated_on[0][s]])
        busy = min(float(p.device_busy_s[on[s]]) for p, on in zip(pipelines, simulated_on, strict=True))
        sync.append(_stage_sync(run_graph, cluster, plan, s, members, phase, pipelines, persistent * shares.gradients,
                                persistent * shares.parameters, per_step, busy, bucket_bytes))
        memory.extend(_stage_memory(cluster, plan, s, persistent, shares, pipelines, simulated_on, bucket_bytes))
    step = max(max(p.step_time_s for p in pipelines), max(x.end_s for x in sync))
    return ParallelResult(plan, step, tuple(pipelines), tuple(simulated_on), tuple(sync),
                          tuple(sorted(memory, key=lambda m: m.device)), run_graph)


def stage_layout(plan: ParallelPlan, stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(device position in the pipeline, chunk on that device) of each op of pipeline stage `stage`: stage k of
    V * pp runs chunk k // pp, on position k % pp (a loop, as interleaved schedules run), or, for the V-shaped
    schedules, on position k on the way out and 2 pp - 1 - k on the way back."""
    chunk = stage // plan.pp
    back = 2 * plan.pp - 1 - stage
    pos = np.where(chunk == 0, stage, back) if plan.schedule in V_SHAPED else stage % plan.pp
    return pos.astype(np.int64), chunk.astype(np.int64)


def _check(graph: CompGraph, cluster: Cluster, stage: np.ndarray, plan: ParallelPlan,
           bucket_bytes: float) -> np.ndarray:
    """The validated stage array; ParallelPlanError naming what does not fit."""
    stage = np.asarray(stage)
    if stage.shape != (graph.num_nodes,) or not np.issubdtype(stage.dtype, np.integer):
        raise ParallelPlanError(f"stages: give one integer stage per op of graph {graph.name!r} "
                                f"({graph.num_nodes} ops), got an array of shape {stage.shape}")
    k = plan.pp * int(plan.chunks or 1)
    if graph.num_nodes and (stage.min() < 0 or stage.max() >= k):
        raise ParallelPlanError(f"stages: every op's stage must be 0..{k - 1} for pp={plan.pp} and {plan.chunks} "
                                f"chunk(s) per device, got {int(stage.min())}..{int(stage.max())}")
    phase = op_phases(graph)
    fwd = (phase[graph.edge_src] == FORWARD) & (phase[graph.edge_dst] == FORWARD)
    back = np.flatnonzero(fwd & (stage[graph.edge_dst] < stage[graph.edge_src]))
    if back.size:
        u, v = int(graph.edge_src[back[0]]), int(graph.edge_dst[back[0]])
        raise ParallelPlanError(f"stages: forward op {graph.ids[u]!r} (stage {int(stage[u])}) feeds {graph.ids[v]!r} "
                                f"(stage {int(stage[v])}); activations flow from each stage to the same or a later one")
    if max(plan.devices or (0,)) >= cluster.num_devices:
        raise ParallelPlanError(f"the plan uses device {max(plan.devices or (0,))} but cluster {cluster.name!r} "
                                f"has {cluster.num_devices} devices (0..{cluster.num_devices - 1})")
    if not bucket_bytes > 0:
        raise ParallelPlanError(f"bucket_bytes must be > 0, got {bucket_bytes!r}")
    own, batch = graph_microbatches(graph), graph_batch(graph)
    if own is not None and (own != plan.microbatches or (batch is not None and batch != plan.microbatch_size)):
        raise ParallelPlanError(f"graph {graph.name!r} is one of {own} micro-batches (batch {batch}); the plan "
                                f"runs M={plan.microbatches} micro-batches of {plan.microbatch_size}: capture at "
                                "batch / dp / M with that M")
    if own is None and batch is not None and batch != plan.batch // plan.dp:
        raise ParallelPlanError(f"graph {graph.name!r} is a step at batch {batch}, but a replica of the plan runs "
                                f"batch {plan.batch} / dp {plan.dp} = {plan.batch // plan.dp}: capture one replica's "
                                "step (or one micro-batch of it)")
    return stage.astype(np.int64)


def _signature(cluster: Cluster, devs: np.ndarray) -> bytes:
    """What a replica's simulation depends on in the cluster: its devices' speeds, kinds and memory and the
    links among them (replicas alike in these simulate alike)."""
    sub = np.ix_(devs, devs)
    kinds = "|".join(cluster.devices[int(d)].kind for d in devs).encode()
    return b"".join([cluster.speeds[devs].tobytes(), cluster.memory[devs].tobytes(), cluster.bandwidth[sub].tobytes(),
                     cluster.latency[sub].tobytes(), kinds])


def _stage_sync(graph: CompGraph, cluster: Cluster, plan: ParallelPlan, s: int, members: np.ndarray,
                phase: np.ndarray, pipelines: list[ScheduledResult], grad_bytes: float, weight_bytes: float,
                per_step: np.ndarray, busy: float, bucket_bytes: float) -> StageSync:
    """Stage s's gradient sync in buckets, its ZeRO traffic and when its step ends (module docstring, 4)."""
    group = plan.stage_group(s)
    zero = plan.zero[s]
    mb = members & (phase != PER_STEP)
    finish = np.max([p.finish_s for p in pipelines], axis=0)  # the slowest replica's last run of each op
    backward_end = float(finish[mb].max(initial=0.0))  # the stage's last micro-batch op: its last backward
    end = float(finish[members].max(initial=0.0))
    if plan.dp == 1:
        return StageSync(s, group, backward_end, backward_end, 0.0, end)
    # when each parameter-holding op's gradient is complete, and how many gradient bytes it holds
    holders = np.flatnonzero(members & (graph.param_bytes > 0))
    ready = np.full(holders.size, backward_end)
    for i, v in enumerate(holders.tolist()):
        if phase[v] == PER_STEP:
            preds = [u for u in graph.predecessors(v) if phase[u] != PER_STEP]
            if preds:
                ready[i] = float(finish[preds].max())
    weight = graph.param_bytes[holders]
    grads = weight / weight.sum() * grad_bytes if weight.sum() > 0 else weight
    kind = "all-reduce" if zero == 0 else "reduce-scatter"
    t = comm = 0.0
    order = np.argsort(ready, kind="stable")
    filled, bucket_ready = 0.0, 0.0
    for j, i in enumerate(order.tolist()):
        filled += grads[i]
        bucket_ready = max(bucket_ready, ready[i])
        if filled >= bucket_bytes or j == order.size - 1:
            cost = collective_s(cluster, group, kind, filled)
            t, comm = max(t, bucket_ready) + cost, comm + cost
            filled = 0.0
    sync_end = max(t, backward_end)
    stage_devices = np.asarray(group, dtype=np.int64)
    update = float(per_step[np.flatnonzero(members)][:, stage_devices].sum(axis=0).max(initial=0.0))
    extra = 0.0
    if zero:
        extra -= update * (1 - 1 / plan.dp)  # each replica updates its shard
    if zero in (1, 2):
        gather = collective_s(cluster, group, "all-gather", weight_bytes)
        extra += gather
        comm += gather
    if zero == 3:  # the first unit's gather precedes all compute; the rest overlap it where it is long enough
        first = collective_s(cluster, group, "all-gather", min(bucket_bytes, weight_bytes))
        gathers = 2 * plan.microbatches * collective_s(cluster, group, "all-gather", weight_bytes)
        extra += first + max(0.0, gathers - first - busy)
        comm += gathers
    return StageSync(s, group, backward_end, sync_end, comm, end + (sync_end - backward_end) + extra)


def _stage_memory(cluster: Cluster, plan: ParallelPlan, s: int, persistent: float, shares: ParamShares,
                  pipelines: list[ScheduledResult], simulated_on: list[tuple[int, ...]],
                  bucket_bytes: float) -> list[MemoryBreakdown]:
    """Memory by category of stage s's devices, one per replica (module docstring, 5)."""
    zero, dp = plan.zero[s], plan.dp
    params = persistent * shares.parameters / (dp if zero == 3 else 1)
    grads = persistent * shares.gradients / (dp if zero >= 2 else 1)
    optimizer = persistent * shares.optimizer_state / (dp if zero >= 1 else 1)
    gathered = min(bucket_bytes, persistent * shares.parameters) if zero == 3 else 0.0
    out = []
    for r, (p, on) in enumerate(zip(pipelines, simulated_on, strict=True)):
        d, sim_d = plan.replica(r)[s], on[s]
        live = float(p.peak_memory_bytes[sim_d]) - persistent
        act = float(p.peak_activation_bytes[sim_d]) if p.peak_activation_bytes is not None else 0.0
        out.append(MemoryBreakdown(d, s, params, grads, optimizer, act, live - act + gathered,
                                   float(cluster.devices[d].memory_bytes)))
    return out
