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
  the schedule's order; the ops inside one action follow the reference model's rule 5;
- the zero-bubble schedules ("zero-bubble", "zbv", "dualpipev": torch's ScheduleInterleavedZeroBubble,
  ScheduleZBVZeroBubble and ScheduleDualPipeV, in the same action order) split a stage's backward into B (input
  gradients) and W (weight gradients: `weight_grad_ops`), run as separate actions, W free to move into the
  bubbles; DualPipeV also runs whole backwards (B and W in one action, FULL) and overlapped actions, a forward
  and a whole backward of two micro-batches, which torch's runtime runs one after the other on the device (its
  OVERLAP_F_B without a custom function): the simulator runs them so, as two actions in a row.

The micro-batch graph: by default the graph is the step of the whole batch and forward/backward ops' compute,
output, temp and the bytes between them are divided by M (an approximation: not every op's cost is linear in
the batch); with `microbatch_graph=True` the caller passes the graph captured at batch/M and nothing is
scaled (exact).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from devplace.errors import GraphError
from devplace.graph.batch import divisors_text, graph_batch, graph_microbatches
from devplace.graph.compgraph import CompGraph
from devplace.graph.modules import segment_spans
from devplace.graph.phases import (
    Accumulation,
    accumulation,
    accumulation_extended,
    per_kind,
    runs_per_step,
    scales_gradients,
    step_compute,
    step_compute_extended,
)
from devplace.graph.schedule import KINDS as VALUE_KINDS
from devplace.graph.schedule import V_SHAPED, Schedule, ScheduleError
from devplace.graph.ties import tie_classes, tie_classes_extended
from devplace.hardware.cluster import Cluster
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.result import SimResult, Transfers

FORWARD, BACKWARD, PER_STEP = 0, 1, 2  # an op's phase
WEIGHT = 3  # the action of a stage's weight-gradient (W) ops under a zero-bubble schedule
FULL = 4  # an action of a stage's whole backward, B and W ops together, under a schedule that splits others
SPLIT_KINDS = ("zero-bubble", *V_SHAPED)  # schedules that run B and W as separate actions
# the kinds a placement alone can run (what placers and `--schedule` offer): a V-shaped pipeline also needs each
# op's chunk (`chunk_of`), which a `ParallelPlan`'s stages give
KINDS = tuple(k for k in VALUE_KINDS if k not in V_SHAPED)
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
    (a captured mobilenet_v3_large has forward-kind clones that read gradients). Read-only, computed once per
    graph (`CompGraph.derived`)."""
    return graph.derived("op_phases", _op_phases)


def _op_phases(graph: CompGraph) -> np.ndarray:
    kinds = graph.kind
    phase = per_kind(kinds, lambda k: PER_STEP if runs_per_step(k) else BACKWARD if k == "backward" else FORWARD,
                     np.int64)
    if not ((phase[graph.edge_src] == BACKWARD) & (phase[graph.edge_dst] == FORWARD)).any():
        return phase  # the common case, checked at once: every simulation of a schedule asks
    for v in graph.topo_order.tolist():
        if phase[v] == FORWARD and (phase[graph.edge_src[graph.in_edges(v)]] == BACKWARD).any():
            phase[v] = BACKWARD
    return phase


def weight_grad_ops(graph: CompGraph) -> np.ndarray:
    """bool[V]: the backward ops classed W (weight gradients) by what they produce: a backward op whose results
    reach the optimizer's updates (per-step ops) and no backward op of another tie class (`graph.ties`: the
    backward of another forward op, where an input gradient goes). Every other backward op is B: input
    gradients, and what both need (a gradient flowing into a layer). A coarse node that merges a layer's B and
    W ops is B. Read-only, computed once per graph."""
    return graph.derived("weight_grad_ops", _weight_grad_ops)


def _weight_grad_ops(graph: CompGraph) -> np.ndarray:
    return _w_ops(graph.topo_order, graph.succ_ptr, graph.succ_edges, graph.edge_dst, op_phases(graph),
                  tie_classes(graph))


@njit(cache=True)
def _w_ops(topo, succ_ptr, succ_edges, edge_dst, phase, classes):  # pragma: no cover - compiled
    """`weight_grad_ops`' rule, successors first: compiled, as a zero-bubble simulation derives it for each split's
    relayed graph."""
    w = np.zeros(topo.shape[0], dtype=np.bool_)
    for i in range(topo.shape[0] - 1, -1, -1):
        v = topo[i]
        if phase[v] != BACKWARD:
            continue
        all_w, any_bwd, to_step = True, False, False
        for k in range(succ_ptr[v], succ_ptr[v + 1]):
            x = edge_dst[succ_edges[k]]
            if phase[x] == BACKWARD:
                any_bwd = True
                all_w = all_w and w[x] and classes[x] == classes[v]
            elif phase[x] == PER_STEP:
                to_step = True
        w[v] = all_w and (to_step or any_bwd)
    return w


def pipeline_stages(graph: CompGraph, devices: np.ndarray, chunks: int,
                    device_order: tuple[int, ...] | None = None, chunk_of: np.ndarray | None = None) -> Stages:
    """The stage of every op under `devices` (see the module docstring), or a ScheduleError when the
    placement is not a pipeline with at most `chunks` chunks per device. The pipeline's devices are in
    `device_order` (devices it does not list after, by index), else by index. `chunk_of` (each op's chunk on
    its device, 0..chunks-1) replaces the chunks read off the data flow: a V-shaped pipeline (zbv), whose
    turn runs two chunks on one device one after the other, needs it."""
    phase = op_phases(graph)
    feeds = np.flatnonzero((phase[graph.edge_src] == PER_STEP) & (phase[graph.edge_dst] != PER_STEP))
    if feeds.size:
        u, v = int(graph.edge_src[feeds[0]]), int(graph.edge_dst[feeds[0]])
        raise ScheduleError(f"op {graph.ids[u]!r} (kind {graph.kind[u]!r}) runs once per step but feeds "
                            f"{graph.ids[v]!r}, which runs once per micro-batch; only forward and backward "
                            "ops may feed micro-batch ops (set their kind)")
    devices = np.asarray(devices, dtype=np.int64)
    rank = {d: i for i, d in enumerate(device_order or ())}
    used = sorted({int(d) for d in np.unique(devices[phase != PER_STEP])}, key=lambda d: (rank.get(d, len(rank)), d))
    pos_of = np.full(int(devices.max(initial=0)) + 1, -1, dtype=np.int64)
    pos_of[np.asarray(used, dtype=np.int64)] = np.arange(len(used))
    pos = np.where(phase != PER_STEP, pos_of[devices], -1)
    if chunk_of is not None:
        chunk = np.asarray(chunk_of)
        mb = phase != PER_STEP
        if chunk.shape != (graph.num_nodes,) or (mb.any() and not (0 <= chunk[mb].min() <= chunk[mb].max() < chunks)):
            raise ScheduleError(f"chunk_of must give every op of graph {graph.name!r} its chunk 0..{chunks - 1}")
        chunk, bad, bad_chunk = np.where(mb, chunk, -1).astype(np.int64), -1, 0
    else:
        floor = (_program_chunks(graph, devices, phase, pos_of) if chunks > 1
                 else np.zeros(graph.num_nodes, dtype=np.int64))
        chunk, bad, bad_chunk = _chunks(graph.topo_order, graph.pred_ptr, graph.pred_edges, graph.edge_src, phase,
                                        pos, devices, tie_classes(graph), chunks, floor)
    if bad >= 0:
        what = ("a pipeline sends activations along its device order only (by index unless the schedule "
                "gives a device_order)" if chunks == 1
                else f"the pipeline wraps around the devices more than chunks={chunks} times")
        raise ScheduleError(f"forward op {graph.ids[bad]!r} on device {int(devices[bad])} would be in chunk {bad_chunk}"
                            f": {what}; place the forward ops in stages along the device indices")
    stage = np.where(phase != PER_STEP, chunk * len(used) + pos, -1)
    return Stages(phase=phase, stage=stage, pipeline_devices=tuple(used), chunks=chunks)


def _program_chunks(graph: CompGraph, devices: np.ndarray, phase: np.ndarray, pos_of: np.ndarray) -> np.ndarray:
    """int64[V]: the chunk the forward program puts each forward op in, a floor under the data flow's: on a
    captured model (segments between module starts, `segment_spans`) each segment runs on the device with most of
    its forward compute (ties: the one with most ops, then the lower index), as the pipeline export cuts it, and
    the chunk grows by one where that device comes before the previous segment's along the pipeline (a wrap
    round the devices). A forward op on its segment's device gets its segment's chunk; every other op 0. Without
    it an op that reads nothing from another device (BART's decoder embedding, a mask built from `arange`) would
    run in chunk 0 of its device although the program, and torch, run it with the later chunk it lies in."""
    floor = np.zeros(graph.num_nodes, dtype=np.int64)
    seg = graph.derived("segment_spans", segment_spans)[:, 0]
    ops = np.flatnonzero((phase == FORWARD) & (seg >= 0))
    if not ops.size:
        return floor
    width = int(devices.max(initial=0)) + 1
    share = np.bincount(seg[ops] * width + devices[ops], weights=graph.compute_s[ops] + 1e-300,
                        minlength=(int(seg[ops].max()) + 1) * width).reshape(-1, width)
    present = np.flatnonzero(share.sum(axis=1) > 0)
    seg_device = share.argmax(axis=1)
    at = pos_of[seg_device[present]]
    chunk = np.zeros(share.shape[0], dtype=np.int64)
    chunk[present] = np.concatenate([[0], np.cumsum(at[1:] < at[:-1])])
    mine = ops[devices[ops] == seg_device[seg[ops]]]
    floor[mine] = chunk[seg[mine]]
    return floor


@njit(cache=True)
def _chunks(topo, pred_ptr, pred_edges, edge_src, phase, pos, devices, classes, chunks, floor):  # pragma: no cover
    """Each op's chunk (-1 for per-step ops), walking the canonical order: a forward op's is the largest of its
    `floor` (`_program_chunks`) and its
    forward predecessors' plus one where data goes back to an earlier pipeline position (`pos`); a backward
    op's is that of its tie class's forward ops (the largest: an input tied to its consumer is a source, in
    chunk 0), else of its first micro-batch predecessor on its device, else the last chunk (where the loss
    is). Returns (chunk, the first forward op whose chunk reaches `chunks` or -1, that chunk)."""
    n = topo.shape[0]
    chunk = np.full(n, -1, dtype=np.int64)
    class_chunk = np.full(n, -1, dtype=np.int64)
    for v in topo:
        if phase[v] != FORWARD:
            continue
        c = floor[v]
        for e in pred_edges[pred_ptr[v]:pred_ptr[v + 1]]:
            u = edge_src[e]
            if phase[u] == FORWARD:
                c = max(c, chunk[u] + (1 if pos[u] > pos[v] else 0))
        if c >= chunks:
            return chunk, v, c
        chunk[v] = c
        class_chunk[classes[v]] = max(c, class_chunk[classes[v]])
    for v in topo:
        if phase[v] != BACKWARD:
            continue
        c = class_chunk[classes[v]]
        if c < 0:
            for e in pred_edges[pred_ptr[v]:pred_ptr[v + 1]]:
                u = edge_src[e]
                if chunk[u] >= 0 and devices[u] == devices[v]:
                    c = chunk[u]
                    break
        chunk[v] = c if c >= 0 else chunks - 1
    return chunk, -1, 0


# --------------------------------------------------------------------------- nodes added to the step as run


def _appended(graph: CompGraph, names: list[str], op: str, kinds: list[str], compute: np.ndarray,
              output_bytes: np.ndarray, param_bytes: np.ndarray, kind_compute: Mapping[str, Sequence[float]],
              edges: tuple[list[int], list[int], list[float], list[int]], *, own_kinds: list[str] | None = None,
              src: np.ndarray | None = None, tensor: np.ndarray | None = None,
              accumulated: Accumulation | None = None) -> CompGraph:
    """`graph` with nodes appended (`relay`'s hops, `tied_copies`' copies): ids `names`, op `op`, kinds `kinds`,
    seconds, output and parameter bytes and seconds per device kind (`kind_compute`, a column per kind of `graph`)
    as given, no group, no temporary bytes; `edges` (sources, destinations, bytes, tensors) appended after the
    graph's own. `own_kinds`, `src` and `tensor` replace the graph's own nodes' kinds and its edges' sources and
    tensors where given. What runs once per step is stored from `graph`'s (`step_compute_extended`, no pass over
    the nodes' records: the appended nodes carry no per-step seconds of their own, and a changed kind may only
    turn per-step), and so is the gradient accumulation (`accumulation_extended`: `graph`'s, none on the appended
    nodes; or `accumulated`, given for every node)."""
    add_src, add_dst, add_bytes, add_tensor = edges
    k = len(names)
    zeros = np.zeros(k)
    g = CompGraph.from_arrays(
        graph.name, [*graph.ids, *names], [*graph.op, *([op] * k)],
        [*(graph.kind if own_kinds is None else own_kinds), *kinds], [*graph.group, *([""] * k)],
        np.concatenate([graph.compute_s, compute]), np.concatenate([graph.output_bytes, output_bytes]),
        np.concatenate([graph.param_bytes, param_bytes]), np.concatenate([graph.temp_bytes, zeros]),
        np.concatenate([graph.edge_src if src is None else src, add_src]).astype(np.int64),
        np.concatenate([graph.edge_dst, add_dst]).astype(np.int64),
        np.concatenate([graph.edge_bytes, add_bytes]),
        np.concatenate([graph.edge_tensor if tensor is None else tensor, add_tensor]).astype(np.int64),
        meta=graph.meta, kind_compute={kind: np.concatenate([col, kind_compute[kind]])
                                       for kind, col in graph.kind_compute.items()},
        node_extra=[*graph.node_extra, *([{}] * k)] if graph.node_extra else ())
    step_compute_extended(g, graph)
    accumulation_extended(g, graph, accumulated)
    return g


# --------------------------------------------------------------------------- values sent past the next stage

RELAY = "relay"  # op name of the nodes that carry a value through a stage it only passes on


@dataclass(frozen=True)
class Relayed:
    """A graph with its relay nodes (`relay`): `origin[i]` is the node of the original graph that node i is, or
    whose output it carries; `devices` and `stages` cover every node."""

    graph: CompGraph
    devices: np.ndarray
    stages: Stages
    origin: np.ndarray


def relay(graph: CompGraph, devices: np.ndarray, stages: Stages, v_shaped: bool = False) -> Relayed:
    """The step as torch's pipelining runs it: a stage sends only to the next stage (forward) and the previous
    one (backward), so a value read further on (Llama's rotary tables, BART's encoder output, a model input the
    last stage's loss reads) is received and sent on by every stage between (`devplace.runtime.pipeline_run`
    makes the stages do so), and so is its gradient on the way back. Each hop is a relay node: no compute, on
    that stage's device, in that stage's forward (or backward) action, one per (value, stage) however many ops
    of later stages read the value. Edges between ops one stage apart, and per-step ops, are left as they are.
    "Next" is along the data: stage numbers (chunk * p + position) as they are, or, `v_shaped` (zbv, dualpipev:
    chunk 1 runs the positions back), position on the way out and 2p - 1 - position on the way back. Returns the
    graph unchanged (no copy) when nothing is sent past the next stage."""
    n, phase = graph.num_nodes, stages.phase
    p = len(stages.pipeline_devices)
    chunk, pos = stages.stage // max(p, 1), stages.stage % max(p, 1)
    # each op's stage along the data (-1: per-step ops); hop s of it has stage number `number(s)`
    stage = (np.where(stages.stage >= 0, np.where(chunk == 1, 2 * p - 1 - pos, stages.stage), -1) if v_shaped
             else stages.stage)

    def number(s: int) -> int:
        return s if not v_shaped or s < p else 3 * p - 1 - s

    u, v = graph.edge_src, graph.edge_dst
    micro = (phase[u] != PER_STEP) & (phase[v] != PER_STEP)
    far = np.flatnonzero(micro & (((phase[u] == FORWARD) & (stage[v] > stage[u] + 1))
                                  | ((phase[u] == BACKWARD) & (stage[v] < stage[u] - 1))))
    if not far.size:
        return Relayed(graph, np.asarray(devices, dtype=np.int64), stages, np.arange(n))
    src, tensor = graph.edge_src.copy(), graph.edge_tensor.copy()
    hop: dict[tuple[int, int, int], int] = {}  # (value's node, its tensor, stage) -> relay node
    names: list[str] = []
    origin: list[int] = []
    hop_stage: list[int] = []
    add_src: list[int] = []
    add_dst: list[int] = []
    add_bytes: list[float] = []
    add_tensor: list[int] = []
    for e in far.tolist():
        a, t = int(u[e]), int(graph.edge_tensor[e])
        step = 1 if stage[v[e]] > stage[a] else -1
        prev, prev_tensor = a, t
        for s in range(int(stage[a]) + step, int(stage[v[e]]), step):
            r = hop.get((a, t, s))
            if r is None:
                r = hop[(a, t, s)] = n + len(origin)
                names.append(f"{graph.ids[a]}:{t}~{RELAY}{s}")
                origin.append(a)
                hop_stage.append(number(s))
                add_src.append(prev)
                add_dst.append(r)
                add_bytes.append(float(graph.edge_bytes[e]))
                add_tensor.append(prev_tensor)
            prev, prev_tensor = r, 0
        src[e], tensor[e] = prev, prev_tensor
    k = len(origin)
    of = np.asarray(origin, dtype=np.int64)
    at = np.asarray(hop_stage, dtype=np.int64)
    hop_devices = np.asarray(stages.pipeline_devices, dtype=np.int64)[at % p]
    zeros = np.zeros(k)
    # relay i's in-edge is the i-th added: a relay holds (outputs) the value it passes on; it runs nothing (and adds
    # no gradient into .grad)
    g = _appended(graph, names, RELAY, ["backward" if phase[a] == BACKWARD else "forward" for a in origin],
                  zeros, np.asarray(add_bytes), zeros, {kind: zeros for kind in graph.kind_compute},
                  (add_src, add_dst, add_bytes, add_tensor), src=src, tensor=tensor)
    # an input is tied to its first successor: relayed past the next stage by its first edge, it would be tied to
    # a relay; else the relays are tied to nothing and the classes need no pass over the nodes (a zero-bubble's W)
    moved = set(far.tolist())
    if (all(int(graph.succ_edges[graph.succ_ptr[x]]) not in moved for x in set(u[far].tolist())
            if graph.op[x] == "input") and set(graph.group).isdisjoint(names)):
        tie_classes_extended(g, graph)
    # stage numbers as given (chunk * p + position, what the action order is built on), not along the data: under a
    # V these differ, and with them a V's chunk-1 actions went unordered wherever a value was relayed
    staged = Stages(phase=np.concatenate([phase, phase[of]]), stage=np.concatenate([stages.stage, at]),
                    pipeline_devices=stages.pipeline_devices, chunks=stages.chunks)
    return Relayed(g, np.concatenate([np.asarray(devices, dtype=np.int64), hop_devices]), staged,
                   np.concatenate([np.arange(n), of]))


# --------------------------------------------------------------------------- tied parameters: a copy per stage

TIED_COPY = "tied-copy"  # op name of a tied parameter's copy on another stage: its gradient sum and its update
SUM_KIND = "optimizer"  # the kind a tied parameter's gradient sum takes: it runs once per step, with the update


def tied_sums(graph: CompGraph, stage: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(summed, root): bool[V] the gradient sums of tied parameters that run once per step (`tied_copies`): a
    backward op reading only backward ops, from two or more of the `stage`s, and feeding only per-step ops or
    other such sums; `root[v]` the last sum of v's chain (v itself where it feeds per-step ops only). Without
    `stage`, every op that is such a sum under some placement (two or more backward inputs): what a bound
    valid for every placement counts once per step (`sim.bounds.lower_bound`)."""
    n, phase = graph.num_nodes, op_phases(graph)
    u, v = graph.edge_src, graph.edge_dst
    summed = np.zeros(n, dtype=bool)
    root = np.arange(n)
    candidates = graph.derived("tied_sum_candidates", _sum_candidates)
    # the candidates whose inputs lie on two or more stages (without stages: are two or more ops), all at once
    inputs = np.flatnonzero(np.isin(v, candidates))
    where = stage[u[inputs]] if stage is not None else u[inputs]
    lo, hi = np.full(n, np.iinfo(np.int64).max), np.full(n, np.iinfo(np.int64).min)
    np.minimum.at(lo, v[inputs], where)
    np.maximum.at(hi, v[inputs], where)
    for a in candidates[lo[candidates] != hi[candidates]].tolist():  # successors first
        succ = v[graph.out_edges(a)]
        if ((phase[succ] == PER_STEP) | summed[succ]).all():
            summed[a] = True
            later = succ[summed[succ]]
            root[a] = root[later[0]] if later.size else a
    return summed, root


def _sum_candidates(graph: CompGraph) -> np.ndarray:
    """The ops `tied_sums` may find to be sums under some placement, successors first (reversed canonical order):
    backward ops with predecessors, all backward, and successors, each per-step or such an op. What the stages
    decide is only whether the predecessors lie on two or more of them; the rest is the graph's, found once
    instead of on every simulation of a split (a walk over every backward op was a third of one)."""
    phase = op_phases(graph)
    u, v = graph.edge_src, graph.edge_dst
    ptr = graph.pred_ptr
    all_backward = np.ones(graph.num_nodes, dtype=bool)  # every predecessor backward (vacuous for none)
    np.logical_and.at(all_backward, v, phase[u] == BACKWARD)
    base = (phase == BACKWARD) & (ptr[1:] > ptr[:-1]) & all_backward & (graph.succ_ptr[1:] > graph.succ_ptr[:-1])
    possible = _possible_sums(graph.topo_order, graph.succ_ptr, graph.succ_edges, v, phase, base)
    order = graph.topo_order[::-1]
    return order[possible[order]]


@njit(cache=True)
def _possible_sums(topo, succ_ptr, succ_edges, dst, phase, base):  # pragma: no cover - compiled
    """`_sum_candidates`' rule, successors first (reversed topological order `topo`): an op of `base` whose every
    successor is per-step or such an op."""
    possible = np.zeros(topo.shape[0], dtype=np.bool_)
    for i in range(topo.shape[0] - 1, -1, -1):
        a = topo[i]
        if not base[a]:
            continue
        ok = True
        for x in range(succ_ptr[a], succ_ptr[a + 1]):
            w = dst[succ_edges[x]]
            if phase[w] != PER_STEP and not possible[w]:
                ok = False
                break
        possible[a] = ok
    return possible


def tied_copies(graph: CompGraph, devices: np.ndarray, stages: Stages) -> Relayed:
    """The step as torch's pipelining runs a parameter used by several stages (an embedding tied with the head,
    `devplace.runtime.pipeline_run`): every stage that uses it holds its own copy (weights, gradient and
    optimizer state), accumulates its own gradient over the micro-batches, and once per step, after the flush,
    the copies' gradients are summed (an all-reduce over the stages' processes) and each copy is updated.

    In a captured graph such a parameter's gradient is a sum: a backward op that reads only gradients
    (backward ops), from two or more stages, and feeds only per-step ops (the update) or other such sums. Those
    sums become per-step ops (kind `SUM_KIND`) on their device, so each stage's contribution is one edge from its
    last micro-batch at full size (the accumulated gradient) instead of a transfer per micro-batch relayed
    through every stage between. Every other stage that contributes gets a copy: one per-step node (op
    `TIED_COPY`, on that stage's device; the sum as placed is the copy of its own stage or of the first
    contributing stage on its device) holding the parameter's `param_bytes` (those of the per-step ops of
    the sum's tie class: weights, gradient, optimizer state), computing the sum and the update (their compute),
    and reading every contribution (edges of the sum's bytes). The exchange is the all-reduce: each copy's
    gradient goes to every other copy's device, all at once (two copies: one transfer each way, S / B +
    latency, where a ring all-reduce of two takes S / B + 2 latencies). A stage that does not use the
    parameter holds nothing of it. Returns the graph unchanged (no copy) when no gradient is summed across
    stages; otherwise `origin` maps every node to the original one it is (a copy: its sum's root)."""
    n, phase, stage = graph.num_nodes, stages.phase, stages.stage
    devices = np.asarray(devices, dtype=np.int64)
    u = graph.edge_src
    summed, root = tied_sums(graph, stage)
    if not summed.any():
        return Relayed(graph, devices, stages, np.arange(n))
    classes = tie_classes(graph)
    kinds = list(graph.kind)
    for w in np.flatnonzero(summed).tolist():
        kinds[w] = SUM_KIND
    names: list[str] = []
    origin: list[int] = []
    copy_dev: list[int] = []
    copy_compute: list[float] = []
    copy_params: list[float] = []
    copy_kind: dict[str, list[float]] = {k: [] for k in graph.kind_compute}
    add_src: list[int] = []
    add_dst: list[int] = []
    add_bytes: list[float] = []
    add_tensor: list[int] = []
    acc = accumulation(graph)
    moved = acc.like([col.copy() for col in acc.columns()])
    for a in np.flatnonzero(summed & (root == np.arange(n))).tolist():
        sums = np.flatnonzero(summed & (root == a))
        edges = np.concatenate([graph.in_edges(w) for w in sums.tolist()])
        edges = edges[~summed[u[edges]]]  # the contributions: each stage's gradient
        # each stage adds its own contribution into its copy's .grad on later micro-batches (and divides it by M),
        # which the captured step did once, after the sum: the adds and divisions move from the sums to one
        # contribution of each stage
        firsts = {int(stage[x]): int(x) for x in u[edges][::-1].tolist()}  # per stage, its first contribution
        for col in moved.columns():
            add = float(col[sums].sum())
            col[sums] = 0.0
            col[list(firsts.values())] += add
        update = np.flatnonzero((phase == PER_STEP) & (classes == classes[a]))
        work = np.concatenate([sums, update])
        sent: dict[tuple[int, int], float] = {}  # (contributing op, its tensor) -> bytes, once each
        for e in edges.tolist():
            sent.setdefault((int(u[e]), int(graph.edge_tensor[e])), float(graph.edge_bytes[e]))
        contributions = [(x, t, nbytes) for (x, t), nbytes in sent.items()]
        on = {int(stage[x]): int(devices[x]) for x, _, _ in contributions}  # contributing stage -> its device
        # the sum and update as placed are the copy of a contributing stage on their device: their own stage, else
        # the first (a V's turn or a placement may put them with another stage of that device)
        here = sorted(st for st, d in on.items() if d == devices[a])
        kept = int(stage[a]) if int(stage[a]) in here else (here[0] if here else -1)
        for s in sorted(set(on) - {kept}):
            c = n + len(origin)
            names.append(f"{graph.ids[a]}~{TIED_COPY}{s}")
            origin.append(a)
            copy_dev.append(on[s])
            copy_compute.append(float(graph.compute_s[work].sum()))
            copy_params.append(float(graph.param_bytes[update].sum()))
            for k, col in graph.kind_compute.items():
                copy_kind[k].append(float(col[work].sum()))
            for x, t, nbytes in contributions:
                add_src.append(x)
                add_dst.append(c)
                add_bytes.append(nbytes)
                add_tensor.append(t)
    k = len(origin)
    zeros = np.zeros(k)
    # the sums take a per-step kind, the copies are of one; the sums' adds and divisions moved to the contributions
    g = _appended(graph, names, TIED_COPY, [SUM_KIND] * k, np.asarray(copy_compute, dtype=float), np.zeros(k),
                  np.asarray(copy_params, dtype=float), copy_kind, (add_src, add_dst, add_bytes, add_tensor),
                  own_kinds=kinds, accumulated=moved.like([np.concatenate([col, zeros]) for col in moved.columns()]))
    # where the sums were of a kind the group rule ties as it ties the per-step one: no pass over the nodes'
    # records for the tie classes
    if (all(graph.kind[w] not in ("", "forward") for w in np.flatnonzero(summed).tolist())
            and set(graph.group).isdisjoint(names)):
        tie_classes_extended(g, graph)
    per_step = np.full(k, PER_STEP, dtype=np.int64)
    staged = Stages(phase=np.concatenate([np.where(summed, PER_STEP, phase), per_step]),
                    stage=np.concatenate([np.where(summed, -1, stage), np.full(k, -1, dtype=np.int64)]),
                    pipeline_devices=stages.pipeline_devices, chunks=stages.chunks)
    return Relayed(g, np.concatenate([devices, np.asarray(copy_dev, dtype=np.int64)]), staged,
                   np.concatenate([np.arange(n), np.asarray(origin, dtype=np.int64)]))


# --------------------------------------------------------------------------- the schedules' action lists


def actions(schedule: Schedule, p: int, r: int) -> list[tuple[int, int, int]]:
    """The actions of pipeline position r of p, in the order it runs them: (phase, chunk, micro-batch); phase
    WEIGHT is the W half of a backward split by a zero-bubble schedule, FULL a whole backward among split ones."""
    m, v = schedule.microbatches, int(schedule.chunks or 1)
    if schedule.kind == "zero-bubble":
        return _zero_bubble_actions(m, v, p, r)
    if schedule.kind == "zbv":
        return _zbv_actions(m, p, r)
    if schedule.kind == "dualpipev":
        return _dualpipev_actions(m, p, r)
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


def _zero_bubble_actions(m: int, v: int, p: int, r: int) -> list[tuple[int, int, int]]:
    """torch's ScheduleInterleavedZeroBubble (ZB1P, arXiv 2401.10241) at position r: micro-batches in rounds
    of M // p (at least 1), a warm-up of forwards one shorter per position, then forward / B pairs, each B
    followed, after the first r of them, by the W of the oldest backward not yet weighed; the rest of the Ws
    at the end. Torch's idle slots do not matter here: the simulator waits for data."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ScheduleError(f"zero-bubble runs the micro-batches in {rounds} equal rounds (M // pipeline devices), "
                            f"which M={m} does not split; use a multiple of {p} or fewer than {p}")
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (p - 1 - r), m * v)
    total = m * v + warmup  # warm-up forwards, then forward + B, then the cooldown's Bs

    def fwd_chunk(step: int) -> int:
        return (step // per_round) % v

    def bwd_chunk(step: int) -> int:
        return v - 1 - ((step - warmup) // per_round) % v
    count = {ph: [0] * v for ph in (FORWARD, BACKWARD, WEIGHT)}

    def act(ph: int, c: int) -> tuple[int, int, int]:
        count[ph][c] += 1
        return (ph, c, count[ph][c] - 1)
    seq: list[tuple[int, int, int]] = []
    backward_steps: list[int] = []
    for step in range(total):
        if step < m * v:
            seq.append(act(FORWARD, fwd_chunk(step)))
        if step < warmup:
            continue
        seq.append(act(BACKWARD, bwd_chunk(step)))
        backward_steps.append(step)
        if step - warmup >= r:
            seq.append(act(WEIGHT, bwd_chunk(backward_steps[len(backward_steps) - 1 - r])))
    weighed = len(backward_steps) - r if len(backward_steps) > r else 0
    seq += [act(WEIGHT, bwd_chunk(s)) for s in backward_steps[weighed:]]
    return seq


def _zbv_actions(m: int, p: int, r: int) -> list[tuple[int, int, int]]:
    """torch's ScheduleZBVZeroBubble (arXiv 2401.10241, section 6) at position r: chunk 0 runs the pipeline's
    stage r, chunk 1 its stage 2p - 1 - r (the way back of the V); its warm-up, steady state and cooldown, with
    the actions of micro-batches >= M (torch plans at least 2p - 1) dropped."""
    n = max(2 * p - 1, m)
    f0, f1, b0, b1, w0, w1 = ((ph, c) for ph in (FORWARD, BACKWARD, WEIGHT) for c in (0, 1))
    count = dict.fromkeys((f0, f1, b0, b1, w0, w1), 0)
    seq: list[tuple[int, int, int]] = []

    def act(*steps: tuple[int, int]) -> None:
        for step in steps:  # each (phase, chunk) runs its next micro-batch
            seq.append((*step, count[step]))
            count[step] += 1
    for _ in range(2 * (p - r) - 1):
        act(f0)
    for _ in range(r):
        act(f1, f0)
    for _ in range(p - r):
        act(f1, b1, w1)
    while count[f1] < count[f0] or count[f0] < n:
        if count[f0] < n:
            act(f0)
        act(b0, w0, f1, b1, w1)
    for _ in range(r):
        act(b0, b1)
    for _ in range(p - r):
        act(b0, w0)
    for w, b in ((w1, b1), (w0, b0)):
        while count[w] < count[b]:
            act(w)
    return [a for a in seq if a[2] < m]


def _dualpipev_actions(m: int, p: int, r: int) -> list[tuple[int, int, int]]:
    """torch's ScheduleDualPipeV (DeepSeek-V3's DualPipe on a V, arXiv 2412.19437) at position r, its eight steps:
    chunk 0 runs the pipeline's stage r, chunk 1 its stage 2p - 1 - r. An overlapped action (a forward of one chunk
    and a whole backward of the other) is its two actions in a row, as torch's runtime runs them; every B (input
    gradients) queues its W, and the queue's oldest runs where the schedule says; the last position's first
    forward of chunk 0 and backward of chunk 1 are not overlapped (torch's choice, to shorten the bubble)."""
    if m < 2 * p:
        raise ScheduleError(f"dualpipev runs at least as many micro-batches as stages: M={m} for {2 * p} stages; use "
                            f"{2 * p} or more")
    count = {key: 0 for key in ((ph, c) for ph in (FORWARD, BACKWARD) for c in (0, 1))}
    queue: list[tuple[int, int]] = []  # (chunk, micro-batch) of the Bs whose W has not run
    seq: list[tuple[int, int, int]] = []

    def act(ph: int, c: int) -> None:
        k = count[(FORWARD if ph == FORWARD else BACKWARD, c)]  # a whole backward counts as a B
        seq.append((ph, c, k))
        count[(FORWARD if ph == FORWARD else BACKWARD, c)] = k + 1
        if ph == BACKWARD:
            queue.append((c, k))

    def weigh() -> None:
        if queue:
            seq.append((WEIGHT, *queue.pop(0)))
    for _ in range((p - r - 1) * 2):  # 1: F0
        act(FORWARD, 0)
    for _ in range(r + 1):  # 2: F0 F1
        act(FORWARD, 0)
        act(FORWARD, 1)
    for _ in range(p - r - 1):  # 3: I1 W F1
        act(BACKWARD, 1)
        weigh()
        act(FORWARD, 1)
    for _ in range(m - 2 * p + r + 1):  # 4: (F0 B1) (F1 B0), overlapped
        act(FORWARD, 0)
        act(FULL, 1)
        act(FORWARD, 1)
        act(FULL, 0)
    for _ in range(p - r - 1):  # 5: B1 (F1 B0)
        act(FULL, 1)
        act(FORWARD, 1)
        act(FULL, 0)
    split = False  # 6: B1 B0, the second half split into I and W
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        act(BACKWARD if split else FULL, 1)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        act(BACKWARD if split else FULL, 0)
    for _ in range(p - r - 1):  # 7: W B0
        weigh()
        act(BACKWARD if split else FULL, 0)
    for _ in range(r + 1):  # 8: W
        weigh()
    return seq


# --------------------------------------------------------------------------- unrolling


@dataclass(frozen=True)
class Unrolled:
    """The step a schedule runs, as a graph: `source[i]` the original node of unrolled node i (-1 for a
    barrier), `microbatch[i]` its micro-batch (-1 for per-step ops and barriers), `devices` its placement,
    `step_part[i]` whether it is the once-per-step part of a micro-batch op (`unroll`)."""

    graph: CompGraph
    source: np.ndarray
    microbatch: np.ndarray
    devices: np.ndarray
    step_part: np.ndarray


def unroll(graph: CompGraph, devices: np.ndarray, schedule: Schedule, stages: Stages,
           cluster: Cluster | None = None) -> Unrolled:
    """The unrolled step (docs/simulation.md, "Pipeline schedules", gives the construction and its order):
    micro-batch ops k = 0..M-1 in node order (id "v@k"), then the per-step ops (id "v"), then the once-per-step
    part of micro-batch ops that merge some (id "v+step": a coarse group's optimizer update, `devplace.graph.phases`;
    after the op's last micro-batch, with the device's per-step ops), then the barriers; every edge of the graph
    in edge order (micro-batch edges once per micro-batch), then the barriers' edges (a "v+step" node waits for
    its device's last barrier only). Built as columns (`CompGraph.from_arrays`): the unrolled step of a large
    model has 10^5+ nodes. A barrier takes its device's `action_s` of `cluster` (the pipelining runtime's work
    per action; the barriers follow the actions one for one where the device has per-step ops), 0 without a
    cluster."""
    m = schedule.microbatches
    b = _body(graph, m, 1.0 if schedule.microbatch_graph else 1.0 / m, stages.phase)
    devices = np.asarray(devices, dtype=np.int64)
    bar_ids, bar_dev, bar_src, bar_dst, bar_tensor = _barriers(
        graph, devices, schedule, stages, b.slot, b.per_mb.size, devices[b.once_nodes], b.once_slots, b.n_real)
    # each barrier costs its device's action_s: compute_s in speed-1.0 units, a device kind's column in seconds
    bar_s = np.array([cluster.devices[d].action_s if cluster is not None else 0.0 for d in bar_dev], dtype=np.float64)
    bar_compute = bar_s * np.array([cluster.devices[d].speed if cluster is not None else 1.0 for d in bar_dev])
    nb = len(bar_ids)
    zeros = np.zeros(nb)
    try:
        g = CompGraph.from_arrays(
            f"{graph.name}-{schedule.kind}-m{m}", b.ids + bar_ids, b.ops + [BARRIER] * nb, b.kinds + [""] * nb,
            [""] * (b.n_real + nb), np.concatenate([b.compute_s, bar_compute]),
            np.concatenate([b.output_bytes, zeros]), np.concatenate([b.param_bytes, zeros]),
            np.concatenate([b.temp_bytes, zeros]), np.concatenate([b.edge_src, bar_src]),
            np.concatenate([b.edge_dst, bar_dst]), np.concatenate([b.edge_bytes, np.zeros(len(bar_src))]),
            np.concatenate([b.edge_tensor, bar_tensor]),
            kind_compute={k: np.concatenate([col, bar_s]) for k, col in b.kind_compute.items()})
    except GraphError as exc:  # a cycle: the action order waits for something that comes later
        raise ScheduleError(f"the {schedule.kind} schedule deadlocks on this placement (the order of a device's "
                            f"actions contradicts the data flow: {exc}); place the ops as a pipeline, stage by "
                            "stage along the device indices") from None
    return Unrolled(g, np.concatenate([b.source, np.full(nb, -1)]), np.concatenate([b.micro, np.full(nb, -1)]),
                    np.concatenate([devices[b.source], np.asarray(bar_dev, dtype=np.int64)]),
                    np.concatenate([b.once_part, np.zeros(nb, dtype=bool)]))


@dataclass(frozen=True, eq=False)
class _Body:
    """What `unroll` builds that does not depend on the placement: every unrolled node but the barriers (micro-batch
    ops k = 0..M-1, per-step ops, once-per-step parts; their ids, ops, kinds and numbers) and every edge but the
    barriers' (`unroll`'s docstring), with where each op's copies begin (`slot`)."""

    per_mb: np.ndarray  # the micro-batch ops
    slot: np.ndarray  # per op: its unrolled node (micro-batch 0's for a micro-batch op)
    once_nodes: np.ndarray  # the per-step ops, then the micro-batch ops with a once-per-step part
    once_slots: np.ndarray  # their unrolled nodes
    n_real: int  # unrolled nodes before the barriers
    source: np.ndarray
    micro: np.ndarray
    once_part: np.ndarray
    ids: list[str]
    ops: list[str]
    kinds: list[str]
    compute_s: np.ndarray
    kind_compute: dict[str, np.ndarray]
    output_bytes: np.ndarray
    param_bytes: np.ndarray
    temp_bytes: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_bytes: np.ndarray
    edge_tensor: np.ndarray


# per graph (while it lives): (M, micro-batch scale, phases) -> its `_Body`. A placer simulates many splits of one
# graph; where nothing is relayed and no tied copy made (`relay`, `tied_copies`) every split unrolls the same graph,
# and only the barriers, which follow the placement, differ.
_BODIES: weakref.WeakKeyDictionary[CompGraph, dict[tuple[int, float, bytes], _Body]] = weakref.WeakKeyDictionary()


def _body(graph: CompGraph, m: int, scale: float, phase: np.ndarray) -> _Body:
    """The placement-independent part of `graph`'s unrolled step under M micro-batches of `scale` of the graph's
    size each, built once per graph and phases (`_BODIES`)."""
    key = (m, scale, phase.tobytes())
    known = _BODIES.setdefault(graph, {})
    if key not in known:
        known[key] = _build_body(graph, m, scale, phase)
    return known[key]


def _build_body(graph: CompGraph, m: int, scale: float, phase: np.ndarray) -> _Body:
    is_mb = phase != PER_STEP
    step = step_compute(graph)
    acc = accumulation(graph)
    # once per step, after the flush, a mean loss's gradients are divided by M (torch's `scale_grads`): a
    # once-per-step part of each op that makes them (`graph.phases`, gradient accumulation)
    divides = m > 1 and scales_gradients(graph)
    once_s = step.compute_s + acc.scale_s if divides else step.compute_s
    once_kind = {k: col + acc.scale_by_kind[k] if divides else col for k, col in step.by_kind.items()}
    per_mb, per_step = np.flatnonzero(is_mb), np.flatnonzero(~is_mb)
    split = per_mb[once_s[per_mb] > 0]  # micro-batch ops with a once-per-step part
    a = per_mb.size
    slot = np.empty(graph.num_nodes, dtype=np.int64)  # index of (v, k=0) for micro-batch ops, of v for the others
    slot[per_mb] = np.arange(a)
    slot[per_step] = m * a + np.arange(per_step.size)
    first_once = m * a + per_step.size
    n_real = first_once + split.size
    source = np.concatenate([np.tile(per_mb, m), per_step, split])
    micro = np.concatenate([np.repeat(np.arange(m), a), np.full(per_step.size + split.size, -1)])
    mult = np.where(micro >= 0, scale, 1.0)
    once_part = np.arange(n_real) >= first_once
    # a run of a micro-batch after the first also adds its gradients into .grad (`graph.phases`, gradient
    # accumulation): folded into the run that makes them, which AccumulateGrad follows at once on its device
    later = micro >= 1

    def compute(total: np.ndarray, step_part: np.ndarray, once: np.ndarray, adds: np.ndarray) -> np.ndarray:
        per_run = np.where(is_mb, total - step_part, total)
        return np.where(once_part, once[source], per_run[source] * mult + np.where(later, adds[source], 0.0))
    params = np.where((micro <= 0) & ~once_part, graph.param_bytes[source], 0.0)  # weights once: with micro-batch 0

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

    # a once-per-step part gets no edge from its op's last micro-batch: the device's last barrier, which it waits
    # for, comes after every action of the device, that run included (same times and ranks), and such an edge
    # would hold that run's output until the update (rule 7): a weight's cast merged with its update, recomputed,
    # held every layer's cast to the step's end (16 GB on a llama3-8b replica)
    once_nodes = np.concatenate([per_step, split])
    ops, kinds = graph.op, graph.kind
    mb_l, once_l = per_mb.tolist(), once_nodes.tolist()
    heads = [f"{w}@" for w in mb_l]  # joined to each micro-batch's number: 2x faster than formatting
    ids = ([head + kk for kk in map(str, range(m)) for head in heads] + [f"{w}" for w in per_step.tolist()]
           + [f"{w}+step" for w in split.tolist()])
    return _Body(
        per_mb=per_mb, slot=slot, once_nodes=once_nodes,
        once_slots=np.concatenate([slot[per_step], first_once + np.arange(split.size)]), n_real=n_real,
        source=source, micro=micro, once_part=once_part, ids=ids,
        # a micro-batch's op and kind columns, repeated M times as one list (C), not looked up per unrolled node
        ops=[ops[w] for w in mb_l] * m + [ops[w] for w in once_l], kinds=[kinds[w] for w in mb_l] * m
        + [kinds[w] for w in once_l], compute_s=compute(graph.compute_s, step.compute_s, once_s, acc.compute_s),
        kind_compute={kk: compute(col, step.by_kind[kk], once_kind[kk], acc.by_kind[kk])
                      for kk, col in graph.kind_compute.items()},
        output_bytes=np.where(once_part, 0.0, graph.output_bytes[source] * mult), param_bytes=params,
        # the later micro-batches' new gradients, held while they are added (the first's is .grad: param_bytes)
        temp_bytes=np.where(once_part, 0.0, graph.temp_bytes[source] * mult
                            + np.where(later, acc.nbytes[source], 0.0)), edge_src=src, edge_dst=dst,
        edge_bytes=ebytes, edge_tensor=graph.edge_tensor[e_of])


def _barriers(graph: CompGraph, devices: np.ndarray, schedule: Schedule, stages: Stages, slot: np.ndarray,
              per_microbatch: int, step_devices: np.ndarray, step_nodes: np.ndarray,
              first: int) -> tuple[list[str], list[int], np.ndarray, np.ndarray, np.ndarray]:
    """Per device, a zero-cost barrier after each non-empty action: it waits for the action's sinks, and the
    next action's sources (or, after the last action, the device's once-per-step nodes: unrolled nodes
    `step_nodes` on `step_devices`) wait for it. Returns the barriers' ids and devices (node indices from `first`
    on) and their edges (src, dst, tensor); op v of micro-batch k is unrolled node slot[v] + k * per_microbatch."""
    p = len(stages.pipeline_devices)
    devices = np.asarray(devices, dtype=np.int64)
    mb = stages.phase != PER_STEP
    action_phase = stages.phase
    if schedule.kind in SPLIT_KINDS:  # a backward op's action is B or W (or, FULL, both)
        action_phase = np.where(weight_grad_ops(graph), WEIGHT, stages.phase)
    # an action's ops: one (device, action phase, stage); its sources have no in-edge from the same action, its
    # sinks no out-edge to it
    width = int(stages.stage.max(initial=0)) + 2  # stage + 1 in 0 .. width - 1
    code = (devices * 4 + action_phase) * width + stages.stage + 1
    u, v = graph.edge_src, graph.edge_dst
    inner = mb[u] & (code[u] == code[v])
    has_pred = np.zeros(graph.num_nodes, dtype=bool)
    has_succ = np.zeros(graph.num_nodes, dtype=bool)
    has_pred[v[inner]] = True
    has_succ[u[inner]] = True
    members = _groups(code, mb)
    step_ops = _groups(step_devices)
    ends: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}  # an action's sources and sinks in micro-batch 0
    ids: list[str] = []
    dev: list[int] = []
    waits: list[np.ndarray] = []  # per barrier, what it waits for, then what waits for it

    for r, d in enumerate(stages.pipeline_devices):
        prev = np.zeros(0, dtype=np.int64)
        for j, (ph, c, k) in enumerate(actions(schedule, p, r)):
            stage = c * p + r
            # a whole backward (FULL) is its B and W ops in one action: its sources and sinks are both's
            keys = tuple((d * 4 + x) * width + stage + 1 for x in ((BACKWARD, WEIGHT) if ph == FULL else (ph,))
                         if stage + 1 < width and (d * 4 + x) * width + stage + 1 in members)
            if not keys:
                continue
            if keys not in ends:  # the same for every micro-batch of the stage: computed once
                ops = np.concatenate([members[x] for x in keys])
                ends[keys] = (slot[ops[~has_pred[ops]]], slot[ops[~has_succ[ops]]])
            sources, sinks = ends[keys]
            if prev.size:
                ids.append(f"#{d}.{j}")
                dev.append(d)
                waits += [prev, sources + k * per_microbatch]
            prev = sinks + k * per_microbatch
        if prev.size and d in step_ops:
            ids.append(f"#{d}.end")
            dev.append(d)
            waits += [prev, step_nodes[step_ops[d]]]
    # barrier b's edges: each node it waits for -> b (a tensor of its own), then b -> each node that waits for it
    sizes = np.array([x.size for x in waits], dtype=np.int64)
    nodes = np.concatenate([np.zeros(0, dtype=np.int64), *waits])
    bar = np.repeat(np.repeat(first + np.arange(len(ids), dtype=np.int64), 2), sizes)
    into = np.repeat(np.tile([True, False], len(ids)), sizes)
    return (ids, dev, np.where(into, nodes, bar), np.where(into, bar, nodes),
            np.where(into, np.int64(BARRIER_TENSOR), np.int64(0)))


def _groups(key: np.ndarray, mask: np.ndarray | None = None) -> dict[int, np.ndarray]:
    """key value -> the indices with that key (where `mask` holds, if given), in index order."""
    nodes = np.flatnonzero(mask) if mask is not None else np.arange(key.size)
    if not nodes.size:
        return {}
    order = nodes[np.argsort(key[nodes], kind="stable")]
    values, first = np.unique(key[order], return_index=True)
    return {int(x): part for x, part in zip(values.tolist(), np.split(order, first[1:]), strict=True)}


# --------------------------------------------------------------------------- simulation


@dataclass(frozen=True, eq=False)
class ScheduledResult(SimResult):
    """A SimResult of a pipelined step. Per node of the original graph, `start_s` is its first run's start
    and `finish_s` its last run's finish; `microbatch_start_s`/`microbatch_finish_s` (M x V) give every
    micro-batch's run (a per-step op's single run in every row); `stage` is each op's pipeline stage (-1 for
    per-step ops); `transfer_microbatch` the micro-batch of each transfer (-1: per-step); `copy_bytes` per device the
    persistent bytes of the tied parameters' copies it holds besides its ops' `param_bytes`."""

    schedule: Schedule
    stage: np.ndarray  # int64[V]
    microbatch_start_s: np.ndarray  # float64[M, V]
    microbatch_finish_s: np.ndarray  # float64[M, V]
    transfer_microbatch: np.ndarray  # int64, one per transfer
    copy_bytes: np.ndarray  # float64[D]: param_bytes of tied parameters' copies held on each device (`tied_copies`)

    def to_dict(self, ids: tuple[str, ...] | None = None, per_op: bool = False) -> dict[str, Any]:
        """SimResult.to_dict plus the schedule, the number of stages and each device's bytes of tied parameters'
        copies (part of its memory, held beside its ops' parameters)."""
        doc = super().to_dict(ids, per_op)
        doc["schedule"] = self.schedule.to_dict()
        doc["num_stages"] = int(self.stage.max()) + 1 if self.stage.size else 0
        doc["tied_copy_bytes"] = self.copy_bytes.tolist()
        return doc


def simulate_schedule(graph: CompGraph, cluster: Cluster, devices: np.ndarray, schedule: Schedule,
                      chunk_of: np.ndarray | None = None) -> ScheduledResult:
    """Simulate one pipelined step of `graph` under `devices` (validated device index per node); `chunk_of`
    each op's chunk on its device where the data flow does not say it (`pipeline_stages`; zbv and dualpipev need
    it)."""
    check_microbatches(graph, schedule)
    devices = np.asarray(devices, dtype=np.int64)
    if schedule.kind in V_SHAPED and chunk_of is None:
        raise ScheduleError(f"the {schedule.kind} schedule runs two chunks per device in a V (stages r and 2p-1-r on "
                            "device r), "
                            "which the placement alone does not tell apart at the turn; give chunk_of, each op's "
                            "chunk, or simulate it through a ParallelPlan with V-shaped stages")
    stages = pipeline_stages(graph, devices, int(schedule.chunks or 1), schedule.device_order, chunk_of)
    # a V's stage numbers (chunk * p + position) are not its order along the data: its hops are not relayed
    tied = tied_copies(graph, devices, stages)
    relayed = relay(tied.graph, tied.devices, tied.stages, schedule.kind in V_SHAPED)
    origin = tied.origin[relayed.origin]
    u = unroll(relayed.graph, relayed.devices, schedule, relayed.stages, cluster)
    r = DevplaceModel(u.graph, cluster).run(u.devices)
    n, m = graph.num_nodes, schedule.microbatches
    mb_start = np.zeros((m, n))
    mb_finish = np.zeros((m, n))
    real = (u.source >= 0) & (u.source < n) & ~u.step_part  # relays and tied copies have no row of their own
    rows = np.where(u.microbatch[real] >= 0, u.microbatch[real], 0)
    mb_start[rows, u.source[real]] = r.start_s[real]
    mb_finish[rows, u.source[real]] = r.finish_s[real]
    step = u.microbatch[real] < 0
    mb_start[:, u.source[real][step]] = r.start_s[real][step]
    mb_finish[:, u.source[real][step]] = r.finish_s[real][step]
    finish = mb_finish.max(axis=0)  # an op's once-per-step part ends its step
    np.maximum.at(finish, u.source[u.step_part], r.finish_s[u.step_part])
    t = r.transfers
    transfers = Transfers(node=origin[u.source[t.node]], tensor=t.tensor, src_dev=t.src_dev, dst_dev=t.dst_dev,
                          nbytes=t.nbytes, start_s=t.start_s, finish_s=t.finish_s)
    return ScheduledResult(
        model=r.model, step_time_s=r.step_time_s, device=devices,
        start_s=mb_start.min(axis=0), finish_s=finish,
        peak_memory_bytes=r.peak_memory_bytes, memory_bytes=r.memory_bytes, device_busy_s=r.device_busy_s,
        comm_bytes=r.comm_bytes, transfers=transfers, schedule=schedule, stage=tied.stages.stage[:n],
        microbatch_start_s=mb_start, microbatch_finish_s=mb_finish, transfer_microbatch=u.microbatch[t.node],
        copy_bytes=np.bincount(tied.devices[n:], weights=tied.graph.param_bytes[n:], minlength=len(cluster.devices)),
        peak_activation_bytes=r.peak_activation_bytes)
