"""The reference simulation model (`--model devplace`), DESIGN.md section 4, compiled with numba.

One event loop over op finishes and transfer arrivals. At each time t it runs a cascade until nothing
more happens at t: process every event at t; let each idle device (in index order) start its ready op with
the smallest (ready time, rank) -- an op of zero duration finishes at t and its finish joins the cascade;
when no device event is left at t, enqueue the transfers of every op that finished at t, ordered by
(rank of the op, tensor, destination device), each on the FIFO channel of its (source, destination) pair.
A transfer that takes zero time (zero latency and zero bytes) arrives at t and restarts the cascade.
Memory is computed afterwards from the schedule as half-open intervals (rule 7), with each instant the loop
visited numbered in time order so that the intervals are ordered by a counting sort, not a comparison sort.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from devplace.defaults import SIM_DEVPLACE
from devplace.graph.compgraph import CompGraph
from devplace.graph.heap import heap_pop, heap_push
from devplace.graph.phases import per_kind
from devplace.graph.tensors import tensor_groups
from devplace.hardware.cluster import Cluster, op_times
from devplace.sim.count import note_simulation
from devplace.sim.result import SimResult, Transfers

# --------------------------------------------------------------------------- the event loop


@njit(cache=True)
def _schedule(dev, dur, active, rank, num_devices, succ_ptr, tsorted_edges, edge_dst, edge_tensor, edge_bytes,
              indeg, bandwidth, latency, chan_free, chan_last):  # pragma: no cover - compiled
    # chan_free, chan_last: [devices, devices] scratch of the caller, 0.0 and -1 everywhere on entry and again on
    # return (only the channels used are touched and reset): allocating them per run cost O(devices^2), 16 MB and
    # most of a run's time at 1,024 devices
    n = dev.shape[0]
    n_e = edge_dst.shape[0]
    start = np.zeros(n, dtype=np.float64)
    finish = np.zeros(n, dtype=np.float64)
    deps = indeg.copy()
    # transfers, at most one per edge
    t_node = np.empty(n_e, dtype=np.int64)
    t_tensor = np.empty(n_e, dtype=np.int64)
    t_dst = np.empty(n_e, dtype=np.int64)
    t_lo = np.empty(n_e, dtype=np.int64)  # tensor group of the producer's out-edges (tsorted_edges slice)
    t_hi = np.empty(n_e, dtype=np.int64)
    t_bytes = np.empty(n_e, dtype=np.float64)
    t_start = np.empty(n_e, dtype=np.float64)
    t_finish = np.empty(n_e, dtype=np.float64)
    edge_transfer = np.full(n_e, -1, dtype=np.int64)
    n_t = 0
    # every instant the loop visits gets an index in time order; memory intervals are bucketed by these
    # indices afterwards, which orders them without a sort
    start_i = np.zeros(n, dtype=np.int64)
    finish_i = np.zeros(n, dtype=np.int64)
    t_start_i = np.empty(n_e, dtype=np.int64)  # -1 - x: starts when transfer x (same channel) arrives
    t_finish_i = np.empty(n_e, dtype=np.int64)
    ti = 0

    # per-device ready heaps keyed by (ready time, rank)
    count = np.zeros(num_devices, dtype=np.int64)
    for v in range(n):
        if active[v]:
            count[dev[v]] += 1
    hbase = np.zeros(num_devices, dtype=np.int64)
    for d in range(1, num_devices):
        hbase[d] = hbase[d - 1] + count[d - 1]
    hsize = np.zeros(num_devices, dtype=np.int64)
    rkt = np.empty(n, dtype=np.float64)
    rkr = np.empty(n, dtype=np.int64)
    rkv = np.empty(n, dtype=np.int64)  # payload: the op
    rank_node = np.empty(n, dtype=np.int64)
    for v in range(n):
        rank_node[rank[v]] = v
    # event heap: key (time, id); id < n is an op finish, id >= n the arrival of transfer id - n
    ekt = np.empty(n + n_e, dtype=np.float64)
    ekr = np.empty(n + n_e, dtype=np.int64)
    ekp = np.empty(n + n_e, dtype=np.int64)  # payload: unused (the id is the key)
    esize = 0
    busy = np.zeros(num_devices, dtype=np.bool_)
    finished_now = np.empty(n, dtype=np.int64)  # ranks of ops finished at the current time
    n_fin = 0
    mark = np.full(num_devices, False)
    marked = np.empty(num_devices, dtype=np.int64)  # the marked devices, sorted before use (few per tensor)

    for v in range(n):
        if active[v] and deps[v] == 0:
            d = dev[v]
            hsize[d] = heap_push(rkt, rkr, rkv, hbase[d], hsize[d], 0.0, rank[v], v)

    t = 0.0
    while True:
        # ---- cascade at time t
        while True:
            while esize > 0 and ekt[0] == t:
                eid = ekr[0]
                esize = heap_pop(ekt, ekr, ekp, 0, esize)
                if eid < n:
                    u = eid
                    a = dev[u]
                    busy[a] = False
                    finish_i[u] = ti
                    finished_now[n_fin] = rank[u]
                    n_fin += 1
                    for k in range(succ_ptr[u], succ_ptr[u + 1]):
                        w = edge_dst[tsorted_edges[k]]
                        if dev[w] == a and active[w]:
                            deps[w] -= 1
                            if deps[w] == 0:
                                hsize[a] = heap_push(rkt, rkr, rkv, hbase[a], hsize[a], t, rank[w], w)
                else:
                    x = eid - n
                    t_finish_i[x] = ti
                    b = t_dst[x]
                    for k in range(t_lo[x], t_hi[x]):
                        w = edge_dst[tsorted_edges[k]]
                        if dev[w] == b and active[w]:
                            deps[w] -= 1
                            if deps[w] == 0:
                                hsize[b] = heap_push(rkt, rkr, rkv, hbase[b], hsize[b], t, rank[w], w)
            for d in range(num_devices):
                if not busy[d] and hsize[d] > 0:
                    v = rkv[hbase[d]]
                    hsize[d] = heap_pop(rkt, rkr, rkv, hbase[d], hsize[d])
                    busy[d] = True
                    start[v] = t
                    start_i[v] = ti
                    finish[v] = t + dur[v]
                    esize = heap_push(ekt, ekr, ekp, 0, esize, finish[v], v, 0)
            if esize > 0 and ekt[0] == t:
                continue
            if n_fin == 0:
                break
            # transfers of every op that finished at t, in (rank, tensor, destination) order
            _sort_few(finished_now, n_fin)  # by rank: the batch of ops finishing at one time is small
            batch = n_fin
            n_fin = 0
            for i in range(batch):
                u = rank_node[finished_now[i]]
                a = dev[u]
                k = succ_ptr[u]
                while k < succ_ptr[u + 1]:
                    tensor = edge_tensor[tsorted_edges[k]]
                    lo = k
                    n_marked = 0
                    while k < succ_ptr[u + 1] and edge_tensor[tsorted_edges[k]] == tensor:
                        w = edge_dst[tsorted_edges[k]]
                        if dev[w] != a and active[w] and not mark[dev[w]]:
                            mark[dev[w]] = True
                            marked[n_marked] = dev[w]
                            n_marked += 1
                        k += 1
                    nbytes = edge_bytes[tsorted_edges[lo]]
                    _sort_few(marked, n_marked)  # destinations in index order
                    for i2 in range(n_marked):
                        b = marked[i2]
                        mark[b] = False
                        if chan_free[a, b] > t:
                            s = chan_free[a, b]
                            t_start_i[n_t] = -1 - chan_last[a, b]
                        else:
                            s = t
                            t_start_i[n_t] = ti
                        f = s + latency[a, b] + nbytes / bandwidth[a, b]
                        chan_free[a, b] = f
                        chan_last[a, b] = n_t
                        t_node[n_t] = u
                        t_tensor[n_t] = tensor
                        t_dst[n_t] = b
                        t_bytes[n_t] = nbytes
                        t_lo[n_t] = lo
                        t_hi[n_t] = k
                        t_start[n_t] = s
                        t_finish[n_t] = f
                        for j in range(lo, k):
                            w = edge_dst[tsorted_edges[j]]
                            if dev[w] == b and active[w]:
                                edge_transfer[tsorted_edges[j]] = n_t
                        esize = heap_push(ekt, ekr, ekp, 0, esize, f, n + n_t, 0)
                        n_t += 1
            if esize > 0 and ekt[0] == t:
                continue
            break
        if esize == 0:
            break
        t = ekt[0]
        ti += 1

    for x in range(n_t):  # transfers that waited on their channel start when the one before arrives
        if t_start_i[x] < 0:
            t_start_i[x] = t_finish_i[-1 - t_start_i[x]]
        chan_free[dev[t_node[x]], t_dst[x]] = 0.0  # the caller's scratch as it was
        chan_last[dev[t_node[x]], t_dst[x]] = -1
    return (start, finish, start_i, finish_i, ti + 1, t_node[:n_t], t_tensor[:n_t], t_dst[:n_t], t_bytes[:n_t],
            t_start[:n_t], t_finish[:n_t], t_start_i[:n_t], t_finish_i[:n_t], edge_transfer)


@njit(cache=True, inline="always")
def _sort_few(values, count):  # pragma: no cover - compiled
    """Sort values[:count] in place, ascending: an insertion sort, for the few items of one instant."""
    for i in range(1, count):
        x = values[i]
        j = i - 1
        while j >= 0 and values[j] > x:
            values[j + 1] = values[j]
            j -= 1
        values[j + 1] = x


@njit(cache=True)
def _peak_memory(dev, active, start_i, finish_i, n_times, num_devices, output_bytes, temp_bytes, param_bytes,
                 edge_src, edge_dst, edge_transfer, t_node, t_dst, t_bytes, t_start_i, t_finish_i,
                 activation):  # pragma: no cover - compiled
    """Peak memory per device (rule 7), from the schedule in time indices (same order as times), and of its
    live part the bytes that are outputs of `activation` nodes (kept or received) at that peak."""
    n = dev.shape[0]
    n_t = t_node.shape[0]
    # free instants: an output when its local consumers are done and its transfers have arrived, a received
    # tensor when its consumers on the receiving device are done
    out_free = finish_i.copy()
    recv_free = t_start_i.copy()
    for e in range(edge_src.shape[0]):
        v = edge_dst[e]
        if not (active[v] and active[edge_src[e]]):
            continue
        x = edge_transfer[e]
        if x < 0:
            u = edge_src[e]
            out_free[u] = max(out_free[u], finish_i[v])
        else:
            recv_free[x] = max(recv_free[x], finish_i[v])
    for x in range(n_t):
        u = t_node[x]
        out_free[u] = max(out_free[u], t_finish_i[x])
    # every nonempty interval [alloc, free) as two changes, bucketed by instant (a counting sort);
    # a zero-length interval (alloc == free) holds nothing and is skipped
    m = 2 * (2 * n + n_t)
    when = np.empty(m, dtype=np.int64)
    delta = np.empty(m, dtype=np.float64)
    where = np.empty(m, dtype=np.int64)
    is_act = np.zeros(m, dtype=np.bool_)
    c = 0
    for v in range(n):
        if not active[v]:
            continue
        if output_bytes[v] > 0 and out_free[v] > start_i[v]:
            is_act[c:c + 2] = activation[v]
            c = _interval(when, delta, where, c, start_i[v], out_free[v], output_bytes[v], dev[v])
        if temp_bytes[v] > 0 and finish_i[v] > start_i[v]:
            c = _interval(when, delta, where, c, start_i[v], finish_i[v], temp_bytes[v], dev[v])
    for x in range(n_t):
        if t_bytes[x] > 0 and recv_free[x] > t_start_i[x]:
            is_act[c:c + 2] = activation[t_node[x]]
            c = _interval(when, delta, where, c, t_start_i[x], recv_free[x], t_bytes[x], t_dst[x])
    bucket = np.zeros(n_times + 1, dtype=np.int64)
    for i in range(c):
        bucket[when[i] + 1] += 1
    for i in range(n_times):
        bucket[i + 1] += bucket[i]
    fill = bucket[:n_times].copy()
    order = np.empty(c, dtype=np.int64)
    for i in range(c):
        order[fill[when[i]]] = i
        fill[when[i]] += 1
    persistent = np.zeros(num_devices, dtype=np.float64)
    for v in range(n):
        if active[v]:
            persistent[dev[v]] += param_bytes[v]
    # all changes at one instant are applied before the peak is read: the same as frees before allocations
    live = np.zeros(num_devices, dtype=np.float64)
    live_act = np.zeros(num_devices, dtype=np.float64)
    peak_live = np.zeros(num_devices, dtype=np.float64)
    peak_act = np.zeros(num_devices, dtype=np.float64)
    for b in range(n_times):
        for k in range(bucket[b], bucket[b + 1]):
            live[where[order[k]]] += delta[order[k]]
            if is_act[order[k]]:
                live_act[where[order[k]]] += delta[order[k]]
        for k in range(bucket[b], bucket[b + 1]):
            d = where[order[k]]
            if live[d] > peak_live[d]:
                peak_live[d] = live[d]
                peak_act[d] = live_act[d]
    return persistent + peak_live, peak_act


@njit(cache=True, inline="always")
def _interval(when, delta, where, c, alloc, free, nbytes, device):  # pragma: no cover - compiled
    when[c], delta[c], where[c] = alloc, nbytes, device
    when[c + 1], delta[c + 1], where[c + 1] = free, -nbytes, device
    return c + 2


# --------------------------------------------------------------------------- Python entry points


class DevplaceModel:
    """The graph- and cluster-derived arrays of the `devplace` model, prepared once; `run(devices)` then
    simulates one placement. Placers that simulate many placements of one graph keep one of these."""

    name = SIM_DEVPLACE

    def __init__(self, graph: CompGraph, cluster: Cluster) -> None:
        self.graph = graph
        self.cluster = cluster
        # out-edges grouped by producer (same slices as succ_ptr), then by tensor, then edge order
        self.tsorted_edges = tensor_groups(graph).edges
        self.indeg = np.bincount(graph.edge_dst, minlength=graph.num_nodes).astype(np.int64)
        self.all_active = np.ones(graph.num_nodes, dtype=np.bool_)
        self.times = op_times(graph, cluster)
        self.memory = cluster.memory
        self.bandwidth = np.ascontiguousarray(cluster.bandwidth)
        self.latency = np.ascontiguousarray(cluster.latency)
        # outputs of forward ops (kind "forward" or none) are activations: what a backward reads
        self.activation = per_kind(graph.kind, lambda k: k in ("", "forward"), np.bool_)
        nd = cluster.num_devices
        self._chan_free = np.zeros((nd, nd), dtype=np.float64)  # `_schedule`'s scratch, reset by it after each run
        self._chan_last = np.full((nd, nd), -1, dtype=np.int64)

    def run(self, devices: np.ndarray, active: np.ndarray | None = None) -> SimResult:
        """Simulate one step with `devices[v]` the device index of node v (already validated).

        With `active` (bool per node), only the subgraph induced by the active nodes is simulated: inactive
        nodes and every edge touching one are ignored (a sequential placer's partial placement).
        """
        note_simulation()
        g = self.graph
        dev = np.ascontiguousarray(devices, dtype=np.int64)
        if active is None:
            active, indeg = self.all_active, self.indeg
        else:
            active = np.ascontiguousarray(active, dtype=np.bool_)
            live = active[g.edge_src] & active[g.edge_dst]
            indeg = np.bincount(g.edge_dst[live], minlength=g.num_nodes).astype(np.int64)
        dur = np.where(active, self.times[np.arange(g.num_nodes), dev], 0.0)
        nd = self.cluster.num_devices
        (start, finish, start_i, finish_i, n_times, t_node, t_tensor, t_dst, t_bytes, t_start, t_finish, t_start_i,
         t_finish_i, edge_transfer) = _schedule(dev, dur, active, g.topo_rank, nd, g.succ_ptr, self.tsorted_edges,
                                                g.edge_dst, g.edge_tensor, g.edge_bytes, indeg, self.bandwidth,
                                                self.latency, self._chan_free, self._chan_last)
        peak, peak_act = _peak_memory(dev, active, start_i, finish_i, n_times, nd, g.output_bytes, g.temp_bytes,
                                      g.param_bytes, g.edge_src, g.edge_dst, edge_transfer, t_node, t_dst, t_bytes,
                                      t_start_i, t_finish_i, self.activation)
        transfers = Transfers(node=t_node, tensor=t_tensor, src_dev=dev[t_node], dst_dev=t_dst, nbytes=t_bytes,
                              start_s=t_start, finish_s=t_finish)
        return SimResult(
            model=self.name,
            step_time_s=float(finish.max()) if finish.size else 0.0,
            device=dev, start_s=start, finish_s=finish,
            peak_memory_bytes=peak, memory_bytes=self.memory, peak_activation_bytes=peak_act,
            device_busy_s=np.bincount(dev, weights=dur, minlength=nd).astype(np.float64),
            comm_bytes=float(t_bytes.sum()),
            transfers=transfers,
        )

    def best_single_device(self) -> tuple[int, float, bool]:
        """(device, step time, fits) of the best single device: the fastest one whose memory holds the
        whole step, or the fastest overall when none does (ties: lowest index)."""
        runs = []
        for d in range(self.cluster.num_devices):
            r = self.run(np.full(self.graph.num_nodes, d, dtype=np.int64))
            runs.append((not r.feasible, r.step_time_s, d))
        infeasible, step, d = min(runs)
        return d, step, not infeasible
