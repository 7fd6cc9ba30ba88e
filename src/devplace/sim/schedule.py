"""Pipelined training steps: a micro-batch `Schedule` (GPipe, 1F1B, interleaved 1F1B) and its simulation.

`simulate_schedule(graph, cluster, devices, schedule)` unrolls the captured step into the step the schedule
runs and simulates that with the reference model (DESIGN.md section 4), so every rule of that model (one op
at a time per device, FIFO channels, memory intervals) holds unchanged. docs/simulation.md, section
"Pipeline schedules", states the rules; in short:

- forward ops (kind "forward" or no kind) and backward ops (kind "backward") run once per micro-batch;
  every other op (the optimizer, ...) once per step, after its device has finished all its micro-batches;
- a forward op's *stage* is (its device, its chunk): the chunk grows by one where data flows from a device
  to one of lower index (the wrap-around of an interleaved pipeline); a backward op is in the stage of the
  forward op it is tied to (`devplace.graph.ties`);
- each device runs its stages' actions (forward or backward of one stage for one micro-batch) strictly in
  the schedule's order; the ops inside one action follow the reference model's rule 5.

The micro-batch graph: by default the graph is the step of the whole batch and forward/backward ops' compute,
output, temp and the bytes between them are divided by M (an approximation: not every op's cost is linear in
the batch); with `microbatch_graph=True` the caller passes the graph captured at batch/M and nothing is
scaled (exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from devplace.errors import GraphError
from devplace.graph.batch import divisors_text, graph_batch, graph_microbatches
from devplace.graph.compgraph import CompGraph
from devplace.graph.schedule import KINDS as KINDS  # re-exported: the kinds are the schedule value's
from devplace.graph.schedule import Schedule, ScheduleError
from devplace.graph.ties import tie_classes
from devplace.hardware.cluster import Cluster
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.result import SimResult, Transfers

FORWARD, BACKWARD, PER_STEP = 0, 1, 2  # an op's phase
BARRIER = "barrier"  # op name of the zero-cost nodes that sequence a device's actions
# the output index of a barrier's in-edges: a 0-byte tensor of its own, so that it never meets a real one
BARRIER_TENSOR = 2**62


# --------------------------------------------------------------------------- micro-batches of a batch

def check_microbatches(graph: CompGraph, schedule: Schedule) -> None:
    """ScheduleError unless `schedule` can run `graph`: a micro-batch graph (`graph_microbatches`) only under
    its own M with `microbatch_graph=True`; a whole step only with an M that divides its batch (when the graph
    records one), so that every micro-batch exists and the global batch is the one captured."""
    m = schedule.microbatches
    own = graph_microbatches(graph)
    if own is not None:
        if m != own or not schedule.microbatch_graph:
            raise ScheduleError(f"graph {graph.name!r} is one of {own} micro-batches of a step (captured at the "
                                f"micro-batch size); it runs under a schedule of M={own} with microbatch_graph=True, "
                                f"got M={m}{'' if schedule.microbatch_graph else ' scaled from a whole batch'}")
        return
    batch = graph_batch(graph)
    if batch is not None and not schedule.microbatch_graph and batch % m:
        raise ScheduleError(f"M={m} micro-batches do not split the batch of {batch} of graph {graph.name!r} into "
                            f"equal micro-batches; with batch {batch} M can be {divisors_text(batch)} (or capture "
                            "with a batch that M divides)")


# --------------------------------------------------------------------------- stages of a placement


@dataclass(frozen=True)
class Stages:
    """How a placement runs as a pipeline: per node its phase (FORWARD, BACKWARD, PER_STEP) and stage
    (chunk * p + position of its device, -1 for per-step ops); `pipeline_devices` the devices that hold
    micro-batch ops, in index order (position r = index in this tuple)."""

    phase: np.ndarray  # int64[V]
    stage: np.ndarray  # int64[V]
    pipeline_devices: tuple[int, ...]
    chunks: int


def op_phases(graph: CompGraph) -> np.ndarray:
    """FORWARD for kind "forward" or "", BACKWARD for "backward", PER_STEP for any other kind -- except that an
    op of the forward kind that depends on a backward op is BACKWARD: it cannot run before the backward pass
    (a captured mobilenet_v3_large has forward-kind clones that read gradients)."""
    kinds = graph.kind
    phase = np.fromiter((FORWARD if k in ("", "forward") else BACKWARD if k == "backward" else PER_STEP
                         for k in kinds), dtype=np.int64, count=graph.num_nodes)
    if not ((phase[graph.edge_src] == BACKWARD) & (phase[graph.edge_dst] == FORWARD)).any():
        return phase  # the common case, checked at once: every simulation of a schedule asks
    for v in graph.topo_order.tolist():
        if phase[v] == FORWARD and (phase[graph.edge_src[graph.in_edges(v)]] == BACKWARD).any():
            phase[v] = BACKWARD
    return phase


def pipeline_stages(graph: CompGraph, devices: np.ndarray, chunks: int,
                    device_order: tuple[int, ...] | None = None) -> Stages:
    """The stage of every op under `devices` (see the module docstring), or a ScheduleError when the
    placement is not a pipeline with at most `chunks` chunks per device. The pipeline's devices are in
    `device_order` (devices it does not list after, by index), else by index."""
    phase = op_phases(graph)
    n = graph.num_nodes
    for e in range(graph.num_edges):
        u, v = int(graph.edge_src[e]), int(graph.edge_dst[e])
        if phase[u] == PER_STEP and phase[v] != PER_STEP:
            raise ScheduleError(f"op {graph.ids[u]!r} (kind {graph.kind[u]!r}) runs once per step but feeds "
                                f"{graph.ids[v]!r}, which runs once per micro-batch; only forward and backward "
                                "ops may feed micro-batch ops (set their kind)")
    rank = {d: i for i, d in enumerate(device_order or ())}
    used = sorted({int(devices[v]) for v in range(n) if phase[v] != PER_STEP},
                  key=lambda d: (rank.get(d, len(rank)), d))
    pos = {d: r for r, d in enumerate(used)}
    chunk = np.full(n, -1, dtype=np.int64)
    classes = tie_classes(graph)
    class_chunk: dict[int, int] = {}
    order = graph.topo_order
    for v in order:  # forward ops: the chunk grows where data goes back to a lower device
        if phase[v] != FORWARD:
            continue
        c = 0
        for e in graph.in_edges(int(v)):
            u = int(graph.edge_src[e])
            if phase[u] == FORWARD:
                wrap = pos[int(devices[u])] > pos[int(devices[v])]
                c = max(c, int(chunk[u]) + int(wrap))
        if c >= chunks:
            what = ("a pipeline sends activations along its device order only (by index unless the schedule "
                    "gives a device_order)" if chunks == 1
                    else f"the pipeline wraps around the devices more than chunks={chunks} times")
            raise ScheduleError(f"forward op {graph.ids[int(v)]!r} on device {int(devices[v])} would be in chunk {c}"
                                f": {what}; place the forward ops in stages along the device indices")
        chunk[v] = c
        # the largest: an input tied to its consumer (labels to the loss) is a source, in chunk 0
        class_chunk[int(classes[v])] = max(c, class_chunk.get(int(classes[v]), 0))
    for v in order:  # backward ops: their forward op's chunk; else the first micro-batch predecessor's on the
        if phase[v] != BACKWARD:  # device; else the last chunk (where the loss is)
            continue
        c = class_chunk.get(int(classes[v]), -1)
        if c < 0:
            for e in graph.in_edges(int(v)):
                u = int(graph.edge_src[e])
                if chunk[u] >= 0 and devices[u] == devices[v]:
                    c = int(chunk[u])
                    break
        chunk[v] = c if c >= 0 else chunks - 1
    p = len(used)
    stage = np.full(n, -1, dtype=np.int64)
    for v in range(n):
        if phase[v] != PER_STEP:
            stage[v] = int(chunk[v]) * p + pos[int(devices[v])]
    return Stages(phase=phase, stage=stage, pipeline_devices=tuple(used), chunks=chunks)


# --------------------------------------------------------------------------- the schedules' action lists


def actions(schedule: Schedule, p: int, r: int) -> list[tuple[int, int, int]]:
    """The actions of pipeline position r of p, in the order it runs them: (phase, chunk, micro-batch)."""
    m, v = schedule.microbatches, int(schedule.chunks or 1)
    if schedule.kind == "gpipe":
        return [(FORWARD, 0, k) for k in range(m)] + [(BACKWARD, 0, k) for k in range(m)]
    if schedule.kind == "1f1b":
        fwd = [(FORWARD, 0, k) for k in range(m)]
        bwd = [(BACKWARD, 0, k) for k in range(m)]
        warmup = min(p - r - 1, m)
    else:  # Megatron-LM's interleaved order: micro-batches in groups of p, chunk by chunk
        if m % p:
            raise ScheduleError(f"interleaved-1f1b needs the number of micro-batches to be a multiple of the "
                                f"pipeline's {p} devices, got microbatches={m}; use a multiple of {p}")
        fwd = [(FORWARD, (k // p) % v, (k // (p * v)) * p + k % p) for k in range(m * v)]
        bwd = [(BACKWARD, v - 1 - (k // p) % v, (k // (p * v)) * p + k % p) for k in range(m * v)]
        warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v)
    seq = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        seq += [fwd[warmup + i], bwd[i]]
    return seq + bwd[len(fwd) - warmup:]


# --------------------------------------------------------------------------- unrolling


@dataclass(frozen=True)
class Unrolled:
    """The step a schedule runs, as a graph: `source[i]` the original node of unrolled node i (-1 for a
    barrier), `microbatch[i]` its micro-batch (-1 for per-step ops and barriers), `devices` its placement."""

    graph: CompGraph
    source: np.ndarray
    microbatch: np.ndarray
    devices: np.ndarray


def unroll(graph: CompGraph, devices: np.ndarray, schedule: Schedule, stages: Stages) -> Unrolled:
    """The unrolled step (docs/simulation.md, "Pipeline schedules", gives the construction and its order):
    micro-batch ops k = 0..M-1 in node order (id "v@k"), then the per-step ops (id "v"), then the barriers;
    every edge of the graph in edge order (micro-batch edges once per micro-batch), then the barriers' edges.
    Built as columns (`CompGraph.from_arrays`): the unrolled step of a large model has 10^5+ nodes."""
    m = schedule.microbatches
    scale = 1.0 if schedule.microbatch_graph else 1.0 / m
    phase = stages.phase
    is_mb = phase != PER_STEP
    per_mb, per_step = np.flatnonzero(is_mb), np.flatnonzero(~is_mb)
    a = per_mb.size
    slot = np.empty(graph.num_nodes, dtype=np.int64)  # index of (v, k=0) for micro-batch ops, of v for the others
    slot[per_mb] = np.arange(a)
    slot[per_step] = m * a + np.arange(per_step.size)
    n_real = m * a + per_step.size
    source = np.concatenate([np.tile(per_mb, m), per_step])
    micro = np.concatenate([np.repeat(np.arange(m), a), np.full(per_step.size, -1)])
    mult = np.where(micro >= 0, scale, 1.0)
    params = np.where(micro <= 0, graph.param_bytes[source], 0.0)  # weights once: with micro-batch 0

    u, v = graph.edge_src, graph.edge_dst
    mu, mv = is_mb[u], is_mb[v]
    reps = np.where(mu & mv, m, 1)
    e_of = np.repeat(np.arange(graph.num_edges), reps)
    k = np.arange(e_of.size) - np.repeat(np.cumsum(reps) - reps, reps)  # micro-batch within an edge's copies
    both = (mu & mv)[e_of]
    # a micro-batch op feeding a per-step op: the accumulated result of the last micro-batch, at full size
    src_k = np.where(both, k, np.where(mu[e_of], m - 1, 0))
    src = slot[u[e_of]] + np.where(mu[e_of], src_k * a, 0)
    dst = slot[v[e_of]] + np.where(both, k * a, 0)
    ebytes = graph.edge_bytes[e_of] * np.where(both, scale, 1.0)

    def index(w: int, kk: int) -> int:
        return int(slot[w]) + (kk * a if is_mb[w] else 0)

    bar_ids, bar_dev, bar_src, bar_dst, bar_tensor = _barriers(graph, devices, schedule, stages, index, n_real)
    ops, kinds = graph.op, graph.kind
    ids = [f"{w}@{kk}" for kk in range(m) for w in per_mb.tolist()] + [f"{w}" for w in per_step.tolist()] + bar_ids
    nb = len(bar_ids)
    src_l = source.tolist()
    try:
        g = CompGraph.from_arrays(
            f"{graph.name}-{schedule.kind}-m{m}", ids, [ops[w] for w in src_l] + [BARRIER] * nb,
            [kinds[w] for w in src_l] + [""] * nb, [""] * (n_real + nb),
            np.concatenate([graph.compute_s[source] * mult, np.zeros(nb)]),
            np.concatenate([graph.output_bytes[source] * mult, np.zeros(nb)]),
            np.concatenate([params, np.zeros(nb)]),
            np.concatenate([graph.temp_bytes[source] * mult, np.zeros(nb)]),
            np.concatenate([src, np.asarray(bar_src, dtype=np.int64)]),
            np.concatenate([dst, np.asarray(bar_dst, dtype=np.int64)]),
            np.concatenate([ebytes, np.zeros(len(bar_src))]),
            np.concatenate([graph.edge_tensor[e_of], np.asarray(bar_tensor, dtype=np.int64)]),
            kind_compute={k: np.concatenate([col[source] * mult, np.zeros(nb)])
                          for k, col in graph.kind_compute.items()})
    except GraphError as exc:  # a cycle: the action order waits for something that comes later
        raise ScheduleError(f"the {schedule.kind} schedule deadlocks on this placement (the order of a device's "
                            f"actions contradicts the data flow: {exc}); place the ops as a pipeline, stage by "
                            "stage along the device indices") from None
    return Unrolled(g, np.concatenate([source, np.full(nb, -1)]), np.concatenate([micro, np.full(nb, -1)]),
                    np.concatenate([np.asarray(devices, dtype=np.int64)[source], np.asarray(bar_dev, dtype=np.int64)]))


def _barriers(graph: CompGraph, devices: np.ndarray, schedule: Schedule, stages: Stages,
              index: Callable[[int, int], int], first: int,
              ) -> tuple[list[str], list[int], list[int], list[int], list[int]]:
    """Per device, a zero-cost barrier after each non-empty action: it waits for the action's sinks, and the
    next action's sources (or, after the last action, the device's per-step ops) wait for it. Returns the
    barriers' ids and devices (node indices from `first` on) and their edges (src, dst, tensor); `index(v, k)`
    is the unrolled node of op v in micro-batch k."""
    p = len(stages.pipeline_devices)
    members: dict[tuple[int, int, int], list[int]] = {}  # (device, phase, stage) -> nodes, insertion order
    for v in range(graph.num_nodes):
        if stages.phase[v] != PER_STEP:
            members.setdefault((int(devices[v]), int(stages.phase[v]), int(stages.stage[v])), []).append(v)
    key = [(int(devices[v]), int(stages.phase[v]), int(stages.stage[v])) for v in range(graph.num_nodes)]
    has_pred = np.zeros(graph.num_nodes, dtype=bool)  # an in-edge from the same action
    has_succ = np.zeros(graph.num_nodes, dtype=bool)
    for e in range(graph.num_edges):
        u, v = int(graph.edge_src[e]), int(graph.edge_dst[e])
        if stages.phase[u] != PER_STEP and key[u] == key[v]:
            has_pred[v] = has_succ[u] = True
    step_ops: dict[int, list[int]] = {}
    for v in range(graph.num_nodes):
        if stages.phase[v] == PER_STEP:
            step_ops.setdefault(int(devices[v]), []).append(v)
    ids: list[str] = []
    dev: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    tensor: list[int] = []

    def barrier(bar_id: str, d: int, before: list[int], after: list[int]) -> None:
        b = first + len(ids)
        ids.append(bar_id)
        dev.append(d)
        src.extend(before)
        dst.extend([b] * len(before))
        tensor.extend([BARRIER_TENSOR] * len(before))
        src.extend([b] * len(after))
        dst.extend(after)
        tensor.extend([0] * len(after))

    for r, d in enumerate(stages.pipeline_devices):
        prev: list[int] = []
        for j, (ph, c, k) in enumerate(actions(schedule, p, r)):
            ops = members.get((d, ph, c * p + r), [])
            if not ops:
                continue
            if prev:
                barrier(f"#{d}.{j}", d, prev, [index(v, k) for v in ops if not has_pred[v]])
            prev = [index(v, k) for v in ops if not has_succ[v]]
        if prev and step_ops.get(d):
            barrier(f"#{d}.end", d, prev, [index(v, 0) for v in step_ops[d]])
    return ids, dev, src, dst, tensor


# --------------------------------------------------------------------------- simulation


@dataclass(frozen=True, eq=False)
class ScheduledResult(SimResult):
    """A SimResult of a pipelined step. Per node of the original graph, `start_s` is its first run's start
    and `finish_s` its last run's finish; `microbatch_start_s`/`microbatch_finish_s` (M x V) give every
    micro-batch's run (a per-step op's single run in every row); `stage` is each op's pipeline stage (-1 for
    per-step ops); `transfer_microbatch` the micro-batch of each transfer (-1: per-step)."""

    schedule: Schedule
    stage: np.ndarray  # int64[V]
    microbatch_start_s: np.ndarray  # float64[M, V]
    microbatch_finish_s: np.ndarray  # float64[M, V]
    transfer_microbatch: np.ndarray  # int64, one per transfer

    def to_dict(self, ids: tuple[str, ...] | None = None, per_op: bool = False) -> dict[str, Any]:
        """SimResult.to_dict plus the schedule and the number of stages."""
        doc = super().to_dict(ids, per_op)
        doc["schedule"] = self.schedule.to_dict()
        doc["num_stages"] = int(self.stage.max()) + 1 if self.stage.size else 0
        return doc


def simulate_schedule(graph: CompGraph, cluster: Cluster, devices: np.ndarray, schedule: Schedule) -> ScheduledResult:
    """Simulate one pipelined step of `graph` under `devices` (validated device index per node)."""
    check_microbatches(graph, schedule)
    devices = np.asarray(devices, dtype=np.int64)
    stages = pipeline_stages(graph, devices, int(schedule.chunks or 1), schedule.device_order)
    u = unroll(graph, devices, schedule, stages)
    r = DevplaceModel(u.graph, cluster).run(u.devices)
    n, m = graph.num_nodes, schedule.microbatches
    mb_start = np.zeros((m, n))
    mb_finish = np.zeros((m, n))
    real = u.source >= 0
    rows = np.where(u.microbatch[real] >= 0, u.microbatch[real], 0)
    mb_start[rows, u.source[real]] = r.start_s[real]
    mb_finish[rows, u.source[real]] = r.finish_s[real]
    step = u.microbatch[real] < 0
    mb_start[:, u.source[real][step]] = r.start_s[real][step]
    mb_finish[:, u.source[real][step]] = r.finish_s[real][step]
    t = r.transfers
    transfers = Transfers(node=u.source[t.node], tensor=t.tensor, src_dev=t.src_dev, dst_dev=t.dst_dev,
                          nbytes=t.nbytes, start_s=t.start_s, finish_s=t.finish_s)
    return ScheduledResult(
        model=r.model, step_time_s=r.step_time_s, device=devices,
        start_s=mb_start.min(axis=0), finish_s=mb_finish.max(axis=0),
        peak_memory_bytes=r.peak_memory_bytes, memory_bytes=r.memory_bytes, device_busy_s=r.device_busy_s,
        comm_bytes=r.comm_bytes, transfers=transfers, schedule=schedule, stage=stages.stage,
        microbatch_start_s=mb_start, microbatch_finish_s=mb_finish, transfer_microbatch=u.microbatch[t.node])
