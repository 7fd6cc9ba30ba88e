"""The list-scheduling core shared by `m-etf`, `m-sct` and `heft` (not a placer itself).

A list scheduler builds a schedule of the whole step -- which device runs each op and when -- and the
placement is the device column of it. The three placers differ only in which (op, device) they pick next;
everything else lives here, once:

**Data-ready time** of op v on device d: the latest arrival of its inputs. An input from producer u on
device a is there at u's finish if a == d; else, if that tensor (u, tensor index) was already sent to d for
another consumer, at that transfer's arrival (each tensor is sent once per destination, as in the
simulator); else a new transfer on the FIFO channel (a, d) of the pair: it starts at
max(u's finish, channel free) and takes `latency_s + bytes / bandwidth_Bps` of that pair. The inputs of v
are taken in the simulator's channel order, (producer finish, producer rank, tensor), so two new transfers
on one channel queue behind each other. Channel contention is tracked: every committed transfer moves its
channel's free time. It is the simulator's per-pair FIFO with one simplification: a channel serves
transfers in the order the scheduler commits them (appending at the channel's free time), not in enqueue
order, so a transfer committed later never jumps ahead of one already committed.

**Memory** (Baechi's accounting): placing v on d needs `param + temp + output + bytes of the inputs d has
to receive` to fit in d's capacity minus what d already holds; devices where it does not fit are skipped.
Placing v charges d its params (held for good), its output, and each received tensor; temp is only
checked (transient). Once every consumer of u is done, u's output is freed on u's device and its received
copies everywhere; "done" is "finished" in the event-driven driver (whose time only moves forward, as in
Baechi, where outputs are freed when their consumers have run) and "placed" in HEFT's (which places ops
out of time order). If no device can take any op that is waiting (and nothing else can happen), the
scheduler is stuck and the placer raises NoFitError.

**Ties** (the autograd rule, `devplace.graph.ties`): the first op of a tie class that is placed pins the class
to its device and charges there the params of the whole class (a layer's optimizer ops update its params
where its forward op put them); the class's other ops are considered on that device only.

**Feasibility**: this bookkeeping follows the scheduler's own schedule, not the simulator's (which orders
each device's ops by ready time and rank), so a placement can still be over memory when simulated.
`place_within_memory` simulates every placement; each device that is over gets the cap
min(cap, the scheduler's own peak on it) - overshoot, and the schedule is redone, at most `RETRIES` times,
then NoFitError.

Two drivers, compiled with numba:

- `ListScheduler.event` (m-ETF, m-SCT): Baechi's event-driven loop. Simulated time t starts at 0. An op is ready
  once all its predecessors have finished (by t). At time t every idle device proposes, among the ready
  ops that fit on it and whose inputs are there by t, the one with the smallest `key` (the tie-break
  rank); the proposal with the smallest key wins (then the lowest device index) and starts at t. This
  repeats until no device proposes; then t advances to the next event: an op finish, or the earliest
  data-ready time of a waiting op on an idle device. This is exactly "at each decision, schedule the
  (op, device) pair with the earliest start, ties by key, then device": every start is >= t, so the
  pairs that can start at t come first. With `favourite` (m-SCT), an idle device whose last op has a
  favourite child that is ready and would start earliest on this device (over all devices with room)
  waits for it, starting meanwhile only an urgent op: one whose urgent time, the latest of its
  earliest starts over all devices with room (Baechi's `urgent_ts`), has come.
- `ListScheduler.heft` (HEFT): ops in a fixed priority order (a topological order); each goes to the device
  with the earliest finish; with `insertion` the op may start in an idle gap of the device's timeline
  between ops already scheduled (Topcuoglu et al.'s insertion policy), else after the device's last op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit

from devplace.graph.compgraph import CompGraph
from devplace.graph.heap import heap_pop, heap_push
from devplace.graph.tensors import tensor_groups
from devplace.graph.ties import untied
from devplace.hardware.cluster import Cluster, op_times
from devplace.placers.common import describe_oom
from devplace.placers.memory import no_fit_error
from devplace.sim.devplace_model import DevplaceModel

RETRIES = 8  # reschedules with lowered caps after a placement the simulator finds over memory

# --------------------------------------------------------------------------- shared compiled pieces


@njit(cache=True)
def _sort_inputs(v, pred_ptr, inputs, edge_src, edge_tensor, finish, rank):  # pragma: no cover - compiled
    """Sort v's in-edges (its slice of `inputs`) by (producer finish, producer rank, tensor): the order in
    which the simulator enqueues their transfers. Insertion sort: in-degrees are small."""
    lo, hi = pred_ptr[v], pred_ptr[v + 1]
    for i in range(lo + 1, hi):
        e = inputs[i]
        fe, re, te = finish[edge_src[e]], rank[edge_src[e]], edge_tensor[e]
        j = i - 1
        while j >= lo:
            x = inputs[j]
            fx, rx, tx = finish[edge_src[x]], rank[edge_src[x]], edge_tensor[x]
            if fx > fe or (fx == fe and (rx > re or (rx == re and tx > te))):
                inputs[j + 1] = x
                j -= 1
            else:
                break
        inputs[j + 1] = e


@njit(cache=True)
def _probe(v, d, commit, num_devices, pred_ptr, inputs, edge_src, edge_gid, gbytes, dev, finish, chan_free,
           arrival, latency, bandwidth, scratch):  # pragma: no cover - compiled
    """(data-ready time of v on d, bytes d must receive for v). With `commit`, the new transfers are booked:
    their channels' free times move and their arrivals are recorded."""
    for a in range(num_devices):
        scratch[a] = chan_free[a, d]
    ready = 0.0
    received = 0.0
    for k in range(pred_ptr[v], pred_ptr[v + 1]):
        e = inputs[k]
        u = edge_src[e]
        a = dev[u]
        if a == d:
            x = finish[u]
        else:
            g = edge_gid[e]
            x = arrival[g * num_devices + d]
            if x < 0.0:  # not sent to d yet: a new transfer on channel (a, d)
                s = max(finish[u], scratch[a])
                x = s + latency[a, d] + gbytes[g] / bandwidth[a, d]
                scratch[a] = x
                received += gbytes[g]
                if commit:
                    arrival[g * num_devices + d] = x
                    chan_free[a, d] = x
        if x > ready:
            ready = x
    return ready, received


@njit(cache=True)
def _release(u, num_devices, dev, out_bytes, grp_ptr, gbytes, arrival, used):  # pragma: no cover - compiled
    """Every consumer of u is placed: free u's output on its device and its received copies."""
    used[dev[u]] -= out_bytes[u]
    for g in range(grp_ptr[u], grp_ptr[u + 1]):
        for d in range(num_devices):
            if arrival[g * num_devices + d] >= 0.0:
                used[d] -= gbytes[g]


@njit(cache=True, inline="always")
def _fits(v, d, received, used, cap, rest, tie, class_params, pin):  # pragma: no cover - compiled
    """Can v go on d? Not if its tie class is pinned to another device; else if d has room for v's output,
    temp and the `received` inputs, plus its class's params when v is the first of its class placed."""
    c = tie[v]
    p = pin[c]
    if p >= 0 and p != d:
        return False
    need = rest[v] + (class_params[c] if p < 0 else 0.0)
    return used[d] + need + received <= cap[d]


@njit(cache=True)
def _place(v, d, s, f, received, num_devices, pred_ptr, inputs, edge_src, edge_gid, gbytes, dev, start, finish,
           chan_free, arrival, latency, bandwidth, scratch, used, peak, tie, class_params, pin, temp_bytes,
           out_bytes):  # pragma: no cover - compiled
    """Put v on d, running [s, f): book its transfers and charge its memory (the peak counts its temp). The
    first op of a tie class placed pins the class to d and charges the params of the whole class."""
    _probe(v, d, True, num_devices, pred_ptr, inputs, edge_src, edge_gid, gbytes, dev, finish, chan_free, arrival,
           latency, bandwidth, scratch)
    dev[v] = d
    start[v] = s
    finish[v] = f
    c = tie[v]
    params = 0.0
    if pin[c] < 0:
        pin[c] = d
        params = class_params[c]
    used[d] += params + out_bytes[v] + received
    peak[d] = max(peak[d], used[d] + temp_bytes[v])


@njit(cache=True)
def _consumed(v, num_devices, pred_ptr, inputs, edge_src, gbytes, dev, arrival, remaining, out_bytes,
              grp_ptr, used):  # pragma: no cover - compiled
    """v has run: free every input whose last consumer it was, and v's own output if it has no consumer."""
    for k in range(pred_ptr[v], pred_ptr[v + 1]):
        u = edge_src[inputs[k]]
        remaining[u] -= 1
        if remaining[u] == 0:
            _release(u, num_devices, dev, out_bytes, grp_ptr, gbytes, arrival, used)
    if remaining[v] == 0:
        _release(v, num_devices, dev, out_bytes, grp_ptr, gbytes, arrival, used)


# --------------------------------------------------------------------------- event-driven: m-ETF, m-SCT


@njit(cache=True)
def _event_schedule(key, favourite, use_favourite, dur, rank, pred_ptr, pred_edges, edge_src, edge_tensor, edge_gid,
                    gbytes, grp_ptr, succ_ptr, succ_edges, edge_dst, tie, class_params, temp_bytes, out_bytes, cap,
                    latency, bandwidth):  # pragma: no cover - compiled
    n, nd = dur.shape
    inf = np.inf
    dev = np.full(n, -1, dtype=np.int64)
    start = np.zeros(n, dtype=np.float64)
    finish = np.zeros(n, dtype=np.float64)
    inputs = pred_edges.copy()
    unfinished = np.zeros(n, dtype=np.int64)  # in-edges whose producer has not finished
    remaining = np.zeros(n, dtype=np.int64)  # out-edges whose consumer has not finished
    for v in range(n):
        unfinished[v] = pred_ptr[v + 1] - pred_ptr[v]
        remaining[v] = succ_ptr[v + 1] - succ_ptr[v]
    rest = temp_bytes + out_bytes
    pin = np.full(class_params.shape[0], -1, dtype=np.int64)  # device of each tie class once one op is placed
    used = np.zeros(nd, dtype=np.float64)
    peak = np.zeros(nd, dtype=np.float64)
    dev_free = np.zeros(nd, dtype=np.float64)
    last = np.full(nd, -1, dtype=np.int64)
    chan_free = np.zeros((nd, nd), dtype=np.float64)
    arrival = np.full(gbytes.shape[0] * nd, -1.0)
    scratch = np.zeros(nd, dtype=np.float64)
    # cached probe per (op, device), valid while the device's version is unchanged: a probe of (v, d)
    # depends only on channels into d and tensors already on d, which change only when an op is put on d
    c_ready = np.zeros(n * nd, dtype=np.float64)
    c_recv = np.zeros(n * nd, dtype=np.float64)
    c_ver = np.full(n * nd, -1, dtype=np.int64)
    ver = np.zeros(nd, dtype=np.int64)
    # ready ops: an unordered array with positions (swap-remove)
    ready = np.empty(n, dtype=np.int64)
    pos = np.full(n, -1, dtype=np.int64)
    n_ready = 0
    urgent = np.empty(n, dtype=np.float64)  # per ready slot, for m-SCT
    # op finishes: heap keyed by (finish, op)
    ht = np.empty(n, dtype=np.float64)
    hv = np.empty(n, dtype=np.int64)
    hp = np.empty(n, dtype=np.int64)  # payload: unused (the op is the key)
    hsize = 0
    for v in range(n):
        if unfinished[v] == 0:
            ready[n_ready] = v
            pos[v] = n_ready
            n_ready += 1
    t = 0.0
    placed = 0
    while placed < n:
        while hsize > 0 and ht[0] <= t:
            u = hv[0]
            hsize = heap_pop(ht, hv, hp, 0, hsize)
            _consumed(u, nd, pred_ptr, inputs, edge_src, gbytes, dev, arrival, remaining, out_bytes, grp_ptr, used)
            for k in range(succ_ptr[u], succ_ptr[u + 1]):
                w = edge_dst[succ_edges[k]]
                unfinished[w] -= 1
                if unfinished[w] == 0:
                    _sort_inputs(w, pred_ptr, inputs, edge_src, edge_tensor, finish, rank)
                    ready[n_ready] = w
                    pos[w] = n_ready
                    n_ready += 1
        # refresh the probes of every ready op on every device
        for i in range(n_ready):
            v = ready[i]
            for d in range(nd):
                c = v * nd + d
                if c_ver[c] != ver[d]:
                    r, b = _probe(v, d, False, nd, pred_ptr, inputs, edge_src, edge_gid, gbytes, dev, finish,
                                  chan_free, arrival, latency, bandwidth, scratch)
                    c_ready[c] = r
                    c_recv[c] = b
                    c_ver[c] = ver[d]
        urgent_done = False
        best_v = -1
        best_d = -1
        next_t = inf
        for d in range(nd):
            if dev_free[d] > t:
                continue  # busy: its op's finish is in the heap
            fc = favourite[last[d]] if use_favourite and last[d] >= 0 else -1
            waits = False
            if fc >= 0 and pos[fc] >= 0:
                # does fc start earliest here, over the devices with room?
                here = inf
                best_est = inf
                for e in range(nd):
                    c = fc * nd + e
                    if _fits(fc, e, c_recv[c], used, cap, rest, tie, class_params, pin):
                        est = max(c_ready[c], dev_free[e], t)
                        best_est = min(best_est, est)
                        if e == d:
                            here = est
                waits = here < inf and here == best_est
                if waits:
                    if not urgent_done:
                        for i in range(n_ready):
                            v = ready[i]
                            latest = -1.0
                            for e in range(nd):
                                c = v * nd + e
                                if _fits(v, e, c_recv[c], used, cap, rest, tie, class_params, pin):
                                    latest = max(latest, c_ready[c], dev_free[e], t)
                            urgent[i] = latest if latest >= 0.0 else inf
                        urgent_done = True
                    cand = -1
                    cu = inf
                    for i in range(n_ready):
                        v = ready[i]
                        if not _fits(v, d, c_recv[v * nd + d], used, cap, rest, tie, class_params, pin):
                            continue
                        if urgent[i] < cu or (urgent[i] == cu and cand >= 0 and key[v] < key[cand]):
                            cu = urgent[i]
                            cand = v
                    if cand >= 0 and cu <= t:
                        pass  # an urgent op runs while the device waits
                    elif here <= t:
                        cand = fc
                    else:
                        next_t = min(next_t, here)
                        if cand >= 0:
                            next_t = min(next_t, cu)
                        cand = -1
            if not waits:
                cand = -1
                for i in range(n_ready):
                    v = ready[i]
                    c = v * nd + d
                    if not _fits(v, d, c_recv[c], used, cap, rest, tie, class_params, pin):
                        continue
                    if c_ready[c] <= t:
                        if cand < 0 or key[v] < key[cand]:
                            cand = v
                    elif c_ready[c] < next_t:
                        next_t = c_ready[c]
            if cand >= 0 and (best_v < 0 or key[cand] < key[best_v]):
                best_v = cand
                best_d = d
        if best_v >= 0:
            v, d = best_v, best_d
            received = c_recv[v * nd + d]
            _place(v, d, t, t + dur[v, d], received, nd, pred_ptr, inputs, edge_src, edge_gid, gbytes, dev, start,
                   finish, chan_free, arrival, latency, bandwidth, scratch, used, peak, tie, class_params, pin,
                   temp_bytes, out_bytes)
            ver[d] += 1
            dev_free[d] = finish[v]
            last[d] = v
            placed += 1
            i = pos[v]
            n_ready -= 1
            ready[i] = ready[n_ready]
            pos[ready[i]] = i
            pos[v] = -1
            hsize = heap_push(ht, hv, hp, 0, hsize, finish[v], v, 0)
            continue
        if hsize > 0:
            next_t = min(next_t, ht[0])
        if next_t == inf:
            break  # stuck: nothing waiting fits anywhere and nothing is running
        t = next_t
    return dev, start, finish, placed, peak


# --------------------------------------------------------------------------- static list: HEFT


@njit(cache=True)
def _heft_schedule(priority, insertion, dur, rank, pred_ptr, pred_edges, edge_src, edge_tensor, edge_gid, gbytes,
                   grp_ptr, succ_ptr, tie, class_params, temp_bytes, out_bytes, cap, latency,
                   bandwidth):  # pragma: no cover - compiled
    n, nd = dur.shape
    dev = np.full(n, -1, dtype=np.int64)
    start = np.zeros(n, dtype=np.float64)
    finish = np.zeros(n, dtype=np.float64)
    inputs = pred_edges.copy()
    remaining = np.zeros(n, dtype=np.int64)
    for v in range(n):
        remaining[v] = succ_ptr[v + 1] - succ_ptr[v]
    rest = temp_bytes + out_bytes
    pin = np.full(class_params.shape[0], -1, dtype=np.int64)
    used = np.zeros(nd, dtype=np.float64)
    peak = np.zeros(nd, dtype=np.float64)
    chan_free = np.zeros((nd, nd), dtype=np.float64)
    arrival = np.full(gbytes.shape[0] * nd, -1.0)
    scratch = np.zeros(nd, dtype=np.float64)
    # each device's busy intervals, sorted by start (non-overlapping)
    busy_s = np.zeros((nd, max(n, 1)), dtype=np.float64)
    busy_f = np.zeros((nd, max(n, 1)), dtype=np.float64)
    count = np.zeros(nd, dtype=np.int64)
    placed = 0
    for v in priority:
        _sort_inputs(v, pred_ptr, inputs, edge_src, edge_tensor, finish, rank)
        best_d = -1
        best_f = np.inf
        best_s = 0.0
        best_k = 0
        best_b = 0.0
        for d in range(nd):
            r, b = _probe(v, d, False, nd, pred_ptr, inputs, edge_src, edge_gid, gbytes, dev, finish, chan_free,
                          arrival, latency, bandwidth, scratch)
            if not _fits(v, d, b, used, cap, rest, tie, class_params, pin):
                continue
            length = dur[v, d]
            m = count[d]
            if insertion:
                # first interval ending after r, then the first gap that holds [s, s + length)
                lo, hi = 0, m
                while lo < hi:
                    mid = (lo + hi) // 2
                    if busy_f[d, mid] <= r:
                        lo = mid + 1
                    else:
                        hi = mid
                s = r
                k = lo
                while k < m and busy_s[d, k] < s + length:
                    s = max(s, busy_f[d, k])
                    k += 1
            else:
                s = max(r, busy_f[d, m - 1]) if m > 0 else r
                k = m
            f = s + length
            if f < best_f:
                best_f, best_d, best_s, best_k, best_b = f, d, s, k, b
        if best_d < 0:
            break  # stuck: v fits nowhere
        d = best_d
        _place(v, d, best_s, best_f, best_b, nd, pred_ptr, inputs, edge_src, edge_gid, gbytes, dev, start, finish,
               chan_free, arrival, latency, bandwidth, scratch, used, peak, tie, class_params, pin, temp_bytes,
               out_bytes)
        _consumed(v, nd, pred_ptr, inputs, edge_src, gbytes, dev, arrival, remaining, out_bytes, grp_ptr, used)
        m = count[d]
        for j in range(m, best_k, -1):
            busy_s[d, j] = busy_s[d, j - 1]
            busy_f[d, j] = busy_f[d, j - 1]
        busy_s[d, best_k] = best_s
        busy_f[d, best_k] = best_f
        count[d] = m + 1
        placed += 1
    return dev, start, finish, placed, peak


# --------------------------------------------------------------------------- Python side


@dataclass(frozen=True)
class Schedule:
    """A list schedule: device, start and finish per op (the scheduler's own estimate, not the simulator's).
    `complete` is False when the scheduler got stuck on memory (then unplaced ops have device -1)."""

    devices: np.ndarray
    start_s: np.ndarray
    finish_s: np.ndarray
    complete: bool
    peak_bytes: np.ndarray  # per device, the most the scheduler's own memory accounting held

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max()) if self.finish_s.size else 0.0


class ListScheduler:
    """The graph- and cluster-derived arrays of the list schedulers, prepared once. `ties` (a tie class per
    node, `devplace.graph.ties`; default: every node its own class) is the autograd rule: the first op of a
    class placed decides the device of all of it, and the class's params are charged there at that moment."""

    def __init__(self, graph: CompGraph, cluster: Cluster, ties: np.ndarray | None = None) -> None:
        self.graph = graph
        self.cluster = cluster
        g = graph
        self.tie = np.ascontiguousarray(untied(g) if ties is None else ties, dtype=np.int64)
        self.class_params = np.bincount(self.tie, weights=g.param_bytes,
                                        minlength=int(self.tie.max(initial=-1)) + 1).astype(np.float64)
        self.dur = op_times(g, cluster)
        # tensor groups: one per (producer, tensor index), numbered in (producer, tensor) order
        groups = tensor_groups(g)
        self.edge_gid = groups.edge_group
        self.gbytes = np.ascontiguousarray(g.edge_bytes[groups.first_edge], dtype=np.float64)
        self.grp_ptr = groups.ptr
        self.cap = cluster.memory.astype(np.float64)
        self.latency = np.ascontiguousarray(cluster.latency)
        self.bandwidth = np.ascontiguousarray(cluster.bandwidth)

    def _common(self) -> tuple:
        g = self.graph
        return (self.dur, g.topo_rank, g.pred_ptr, g.pred_edges, g.edge_src, g.edge_tensor, self.edge_gid,
                self.gbytes, self.grp_ptr)

    def event(self, key: np.ndarray, favourite: np.ndarray | None = None,
              cap: np.ndarray | None = None) -> Schedule:
        """m-ETF (and, with `favourite` child per op or -1, m-SCT): see the module docstring. `key[v]` is
        v's tie-break rank among ops that can start at the same time (smaller first)."""
        g = self.graph
        fav = np.full(g.num_nodes, -1, dtype=np.int64) if favourite is None else favourite.astype(np.int64)
        dur, rank, pred_ptr, pred_edges, edge_src, edge_tensor, edge_gid, gbytes, grp_ptr = self._common()
        dev, start, finish, placed, peak = _event_schedule(
            np.ascontiguousarray(key, dtype=np.int64), fav, favourite is not None, dur, rank, pred_ptr, pred_edges,
            edge_src, edge_tensor, edge_gid, gbytes, grp_ptr, g.succ_ptr, g.succ_edges, g.edge_dst, self.tie,
            self.class_params, g.temp_bytes, g.output_bytes, self.cap if cap is None else cap, self.latency,
            self.bandwidth)
        return Schedule(dev, start, finish, int(placed) == g.num_nodes, peak)

    def heft(self, priority: np.ndarray, insertion: bool = True, cap: np.ndarray | None = None) -> Schedule:
        """HEFT: ops in `priority` (a topological order), each to its earliest-finish device with room."""
        g = self.graph
        dur, rank, pred_ptr, pred_edges, edge_src, edge_tensor, edge_gid, gbytes, grp_ptr = self._common()
        dev, start, finish, placed, peak = _heft_schedule(
            np.ascontiguousarray(priority, dtype=np.int64), bool(insertion), dur, rank, pred_ptr, pred_edges,
            edge_src, edge_tensor, edge_gid, gbytes, grp_ptr, g.succ_ptr, self.tie, self.class_params, g.temp_bytes,
            g.output_bytes, self.cap if cap is None else cap, self.latency, self.bandwidth)
        return Schedule(dev, start, finish, int(placed) == g.num_nodes, peak)


def place_within_memory(graph: CompGraph, cluster: Cluster, placer: str,
                        schedule: Callable[[np.ndarray], Schedule]) -> np.ndarray:
    """Run `schedule(caps)` and simulate its placement; while the simulator finds a device over memory,
    lower that device's cap by its overshoot and schedule again (at most `RETRIES` times). Returns the
    device per node of a feasible placement, or raises NoFitError."""
    caps = cluster.memory.astype(np.float64)
    model = DevplaceModel(graph, cluster)
    for attempt in range(RETRIES + 1):
        sched = schedule(caps)
        if not sched.complete:
            stuck = int((sched.devices < 0).sum())
            why = (f"{stuck} ops fit on no device once the others were placed" if attempt == 0 else
                   f"after {attempt} reschedules with lower caps to keep the simulated peaks within memory, "
                   f"{stuck} ops fit on no device")
            raise no_fit_error(graph, cluster, placer, why)
        result = model.run(sched.devices)
        if result.feasible:
            return sched.devices
        caps = caps.copy()
        for d in result.oom:
            over = float(result.peak_memory_bytes[d]) - float(result.memory_bytes[d])
            caps[d] = min(caps[d], float(sched.peak_bytes[d])) - over
    raise no_fit_error(graph, cluster, placer, f"after {RETRIES} reschedules its placement is still over memory "
                       f"on {describe_oom(result)}")
