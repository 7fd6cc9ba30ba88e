"""The `placeto` simulation model (DESIGN.md section 5), compiled with numba.

A re-implementation, in devplace's own code, of the event-driven simulator that Placeto and the seed study
used (`sim/tf_placement_sim/tf_sim.py` of `aravic/generalizable-device-placement`), faithful to its timing:

- one global event queue ordered by (time, kind, key) with kind 0 = dependency removal, 1 = bus work,
  2 = device work; the key of a dependency removal is (producer id, consumer id) compared as strings,
  then the output index; the key of bus/device work is the device index;
- every device runs its ready ops FIFO (by ready time, then by the moment they became ready); after an op
  whose time is not exactly 0 the device stays busy `delta1_s` more;
- every device has one outgoing bus; when op u finishes, each output index of u needed on another device
  is sent once (a broadcast) at `bytes / bus_Bps`, FIFO; the bus then stays busy `delta2_s` more, which
  does not delay the arrival;
- an op is ready when every in-edge is satisfied: at the producer's finish (same device) or at the
  arrival of the producer's send of that edge's output index;
- step time = the time of the last processed event (trailing delta1/delta2 tails included).

The reference's input conversion (a control input is read as output 0 of its producer; a consumer keeps
one output index per producer, the last; only output 0's bytes are profiled) is not part of the model:
`reference_form` rewrites a graph the first two ways (docs/sim-placeto.md gives the reasoning).

Memory: persistent `param_bytes` on the op's device all step, `temp_bytes` while the op runs, and the op's
`output_bytes` on its own device from its start to the finish of its last consumer (Placeto's rule);
half-open intervals, frees before allocations at equal times.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from devplace.defaults import SIM_PLACETO
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.graph.heap import heap_pop, heap_push
from devplace.graph.tensors import tensor_groups
from devplace.hardware.cluster import Cluster, op_times
from devplace.sim.count import note_simulation
from devplace.sim.result import SimResult, Transfers

MODEL = SIM_PLACETO  # "placeto-sim": the Placeto paper's simulator (not the placer, not its encoder)
DELTA1_S = 5.7e-6  # device busy after an op of nonzero time (reference: 5.7 us)
DELTA2_S = 25e-6  # bus busy after a send, not delaying the arrival (reference: 25 us)

# --------------------------------------------------------------------------- the event heap
# Event kinds, in the order the reference processes them at equal times: dependency removal, bus work,
# device work. Entries are keyed (time, key) with one int key that sorts as the reference's (kind, key): a dependency
# removal of out-edge k has key dep_rank[k], the rank of its (name rank of the producer, name rank of the
# consumer, output index) among all out-edges; bus work of device d has n_k + d, device work n_k + D + d.
# The payload is the consumer of a dependency removal, the device of bus/device work. Two dependency
# removals with equal keys are of the same (producer, consumer, output index), so interchangeable, and
# there is at most one pending entry per bus and per device: pops come in the reference's order.


# --------------------------------------------------------------------------- the event loop


@njit(cache=True)
def _schedule(dev, dur, pause, dep_rank, num_devices, kptr, kdst, kslot, slot_tensor, slot_bytes, indeg,
              delta2, bus_bps):  # pragma: no cover - compiled
    """Run the event loop. Out-edges are CSR by producer, each slice ordered by (consumer index, edge
    order); kslot[k] is the (producer, output index) slot of out-edge k, dep_rank[k] its dependency removal's
    key (see the event heap); indeg[v] counts v's in-edges."""
    n = dev.shape[0]
    n_k = kdst.shape[0]
    n_slots = slot_tensor.shape[0]
    start = np.zeros(n, dtype=np.float64)
    finish = np.zeros(n, dtype=np.float64)
    remaining = indeg.copy()

    # device FIFOs as linked lists over nodes
    dhead = np.full(num_devices, -1, dtype=np.int64)
    dtail = np.full(num_devices, -1, dtype=np.int64)
    dnext = np.full(n, -1, dtype=np.int64)
    dbusy = np.zeros(num_devices, dtype=np.bool_)

    # bus items (one per sent output index), FIFO per source device as linked lists over items
    item_node = np.empty(n_k, dtype=np.int64)
    item_slot = np.empty(n_k, dtype=np.int64)
    item_ready = np.empty(n_k, dtype=np.float64)
    item_start = np.empty(n_k, dtype=np.float64)
    item_arrive = np.empty(n_k, dtype=np.float64)
    item_cptr = np.empty(n_k, dtype=np.int64)
    item_ccount = np.zeros(n_k, dtype=np.int64)
    item_next = np.full(n_k, -1, dtype=np.int64)
    children = np.empty(n_k, dtype=np.int64)  # out-edges to the consumers waiting for each item, grouped by item
    n_items = 0
    n_children = 0
    slot_item = np.full(n_slots, -1, dtype=np.int64)  # item of a (producer, output index); each op runs once
    bhead = np.full(num_devices, -1, dtype=np.int64)
    btail = np.full(num_devices, -1, dtype=np.int64)
    bbusy = np.zeros(num_devices, dtype=np.bool_)
    sent = np.empty(n_k, dtype=np.int64)  # items in the order their sends started
    n_sent = 0

    # event heap: at most one dependency removal per edge, one pending entry per bus and per device
    cap = n_k + 2 * num_devices + 1
    ht = np.empty(cap, dtype=np.float64)
    hk = np.empty(cap, dtype=np.int64)
    hp = np.empty(cap, dtype=np.int64)
    size = 0
    bus_key = n_k
    dev_key = n_k + num_devices

    # sources, in node order, become ready at time 0
    for v in range(n):
        if remaining[v] == 0:
            d = dev[v]
            if dtail[d] < 0:
                dhead[d] = v
            else:
                dnext[dtail[d]] = v
            dtail[d] = v
            if not dbusy[d]:
                dbusy[d] = True
                size = heap_push(ht, hk, hp, 0, size, 0.0, dev_key + d, d)

    step = 0.0
    while size > 0:
        t = ht[0]
        key = hk[0]
        p = hp[0]
        size = heap_pop(ht, hk, hp, 0, size)
        if t > step:
            step = t
        if key < bus_key:  # a dependency removal
            c = p
            remaining[c] -= 1
            if remaining[c] == 0:
                d = dev[c]
                if dtail[d] < 0:
                    dhead[d] = c
                else:
                    dnext[dtail[d]] = c
                dtail[d] = c
                if not dbusy[d]:
                    dbusy[d] = True
                    size = heap_push(ht, hk, hp, 0, size, t, dev_key + d, d)
        elif key < dev_key:  # bus work
            d = p
            it = bhead[d]
            if it < 0:
                bbusy[d] = False
                continue
            if item_ready[it] > t:  # the next send waits for its producer to finish
                size = heap_push(ht, hk, hp, 0, size, item_ready[it], bus_key + d, d)
                continue
            bhead[d] = item_next[it]
            if bhead[d] < 0:
                btail[d] = -1
            s = item_slot[it]
            arrive = t + slot_bytes[s] / bus_bps
            item_start[it] = t
            item_arrive[it] = arrive
            sent[n_sent] = it
            n_sent += 1
            for j in range(item_cptr[it], item_cptr[it] + item_ccount[it]):
                k = children[j]
                size = heap_push(ht, hk, hp, 0, size, arrive, dep_rank[k], kdst[k])
            size = heap_push(ht, hk, hp, 0, size, arrive + delta2, bus_key + d, d)
        else:  # device work
            d = p
            u = dhead[d]
            if u < 0:
                dbusy[d] = False
                continue
            dhead[d] = dnext[u]
            if dhead[d] < 0:
                dtail[d] = -1
            f = t + dur[u]
            start[u] = t
            finish[u] = f
            size = heap_push(ht, hk, hp, 0, size, f + pause[u], dev_key + d, d)
            # local in-edges are satisfied at u's finish; remote ones wait for one send per output index,
            # the sends created in the order of their first remote out-edge
            first_item = n_items
            for k in range(kptr[u], kptr[u + 1]):
                c = kdst[k]
                s = kslot[k]
                if dev[c] == d:
                    size = heap_push(ht, hk, hp, 0, size, f, dep_rank[k], c)
                else:
                    if slot_item[s] < 0:
                        slot_item[s] = n_items
                        item_node[n_items] = u
                        item_slot[n_items] = s
                        item_ready[n_items] = f
                        item_ccount[n_items] = 0
                        n_items += 1
                    item_ccount[slot_item[s]] += 1
            for it in range(first_item, n_items):
                item_cptr[it] = n_children
                n_children += item_ccount[it]
                item_ccount[it] = 0
            for k in range(kptr[u], kptr[u + 1]):
                c = kdst[k]
                if dev[c] != d:
                    it = slot_item[kslot[k]]
                    children[item_cptr[it] + item_ccount[it]] = k
                    item_ccount[it] += 1
            for it in range(first_item, n_items):
                if btail[d] < 0:
                    bhead[d] = it
                else:
                    item_next[btail[d]] = it
                btail[d] = it
                if not bbusy[d]:
                    bbusy[d] = True
                    size = heap_push(ht, hk, hp, 0, size, f, bus_key + d, d)

    order = sent[:n_sent]
    t_node = item_node[order]
    t_slot = item_slot[order]
    return (start, finish, step, t_node, slot_tensor[t_slot], slot_bytes[t_slot], item_start[order],
            item_arrive[order])


@njit(cache=True)
def _peak_live(dev, start, finish, num_devices, output_bytes, temp_bytes, kptr, kdst):  # pragma: no cover
    """Peak over time of live outputs + temp memory per device (persistent memory not included)."""
    n = dev.shape[0]
    out_free = finish.copy()  # an output lives until its last consumer finishes (own finish if none)
    for u in range(n):
        for k in range(kptr[u], kptr[u + 1]):
            c = kdst[k]
            if finish[c] > out_free[u]:
                out_free[u] = finish[c]
    # nonempty intervals [alloc, free) as two events; frees written first so that a stable sort by time
    # applies frees before allocations at equal times
    times = np.empty(4 * n, dtype=np.float64)
    delta = np.empty(4 * n, dtype=np.float64)
    where = np.empty(4 * n, dtype=np.int64)
    c = 0
    for phase in range(2):  # 0: frees, 1: allocations
        sign = -1.0 if phase == 0 else 1.0
        for v in range(n):
            if output_bytes[v] > 0 and out_free[v] > start[v]:
                times[c] = out_free[v] if phase == 0 else start[v]
                delta[c] = sign * output_bytes[v]
                where[c] = dev[v]
                c += 1
            if temp_bytes[v] > 0 and finish[v] > start[v]:
                times[c] = finish[v] if phase == 0 else start[v]
                delta[c] = sign * temp_bytes[v]
                where[c] = dev[v]
                c += 1
    live = np.zeros(num_devices, dtype=np.float64)
    peak = np.zeros(num_devices, dtype=np.float64)
    for i in np.argsort(times[:c], kind="mergesort"):
        d = where[i]
        live[d] += delta[i]
        if live[d] > peak[d]:
            peak[d] = live[d]
    return peak


# --------------------------------------------------------------------------- Python entry points


def _check_param(name: str, value: float, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise DevplaceError(f"placeto model: {name} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise DevplaceError(f"placeto model: {name} must be a finite number {'> 0' if positive else '>= 0'}, "
                            f"got {value!r}")
    return x


def _groups(*keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stable sort order by `keys` (the last key is the primary one, as in np.lexsort) and the group id
    (equal keys) of each position in that order."""
    order = np.lexsort(keys)
    new = np.ones(order.shape[0], dtype=bool)
    if order.shape[0]:
        new[1:] = np.any([k[order][1:] != k[order][:-1] for k in keys], axis=0)
    return order, np.cumsum(new) - 1


class PlacetoSimModel:
    """The placement-independent arrays of the `placeto-sim` model, prepared once; `run(devices)` then simulates
    one placement. Placers that simulate many placements of one graph keep one of these."""

    name = MODEL

    def __init__(self, graph: CompGraph, cluster: Cluster, *, delta1_s: float = DELTA1_S,
                 delta2_s: float = DELTA2_S, bus_Bps: float | None = None) -> None:
        self.graph = graph
        self.cluster = cluster
        self.delta1_s = _check_param("delta1_s", delta1_s)
        self.delta2_s = _check_param("delta2_s", delta2_s)
        self.bus_Bps = _check_param("bus_Bps", cluster.link.bandwidth_Bps if bus_Bps is None else bus_Bps,
                                    positive=True)
        self.times = op_times(graph, cluster)
        self.memory = cluster.memory
        n, n_e = graph.num_nodes, graph.num_edges
        src, dst, tensor = graph.edge_src, graph.edge_dst, graph.edge_tensor
        # out-edges by producer, then consumer index, then edge order (the reference's children order)
        out = np.lexsort((dst, src))  # stable: edge order within a (producer, consumer) pair
        self.kdst = dst[out].astype(np.int64)
        self.kptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(src, minlength=n), out=self.kptr[1:])
        self.indeg = np.bincount(dst, minlength=n).astype(np.int64)
        # one slot per (producer, output index), its tensor group; all its edges have the same bytes
        groups = tensor_groups(graph)
        self.kslot = groups.edge_group[out]
        self.slot_tensor = tensor[groups.first_edge].astype(np.int64)
        self.slot_bytes = graph.edge_bytes[groups.first_edge].astype(np.float64)
        # tie-break of dependency removals at equal times: (producer id, consumer id) compared as strings, then
        # the output index, as one rank per out-edge (the event heap's key)
        name_rank = np.empty(n, dtype=np.int64)
        name_rank[sorted(range(n), key=graph.ids.__getitem__)] = np.arange(n, dtype=np.int64)
        dep_order, dep_group = _groups(self.slot_tensor[self.kslot], name_rank[self.kdst], name_rank[src[out]])
        self.dep_rank = np.empty(n_e, dtype=np.int64)
        self.dep_rank[dep_order] = dep_group

    def run(self, devices: np.ndarray) -> SimResult:
        """Simulate one step with `devices[v]` the device index of node v (already validated)."""
        note_simulation()
        g = self.graph
        nd = self.cluster.num_devices
        dev = np.ascontiguousarray(devices, dtype=np.int64)
        dur = self.times[np.arange(g.num_nodes), dev]
        pause = np.where(dur == 0.0, 0.0, self.delta1_s)
        start, finish, step, t_node, t_tensor, t_bytes, t_start, t_finish = _schedule(
            dev, dur, pause, self.dep_rank, nd, self.kptr, self.kdst, self.kslot, self.slot_tensor,
            self.slot_bytes, self.indeg, self.delta2_s, self.bus_Bps)
        persistent = np.bincount(dev, weights=g.param_bytes, minlength=nd).astype(np.float64)
        peak = persistent + _peak_live(dev, start, finish, nd, g.output_bytes, g.temp_bytes, self.kptr,
                                       self.kdst)
        transfers = Transfers(node=t_node, tensor=t_tensor, src_dev=dev[t_node],
                              dst_dev=np.full(t_node.shape[0], -1, dtype=np.int64), nbytes=t_bytes,
                              start_s=t_start, finish_s=t_finish)
        return SimResult(
            model=MODEL,
            step_time_s=float(step),
            device=dev, start_s=start, finish_s=finish,
            peak_memory_bytes=peak, memory_bytes=self.memory,
            device_busy_s=np.bincount(dev, weights=dur, minlength=nd).astype(np.float64),
            comm_bytes=float(t_bytes.sum()),
            transfers=transfers,
        )



PlacetoModel = PlacetoSimModel  # the old name, kept for code that imports it

def simulate_placeto(graph: CompGraph, cluster: Cluster, devices: np.ndarray, *, delta1_s: float = DELTA1_S,
                     delta2_s: float = DELTA2_S, bus_Bps: float | None = None) -> SimResult:
    """Simulate one training step of `graph` on `cluster` with the `placeto` model (DESIGN.md section 5).

    `devices[v]` is the device index of node v (node order, already validated). `delta1_s` is how long a
    device stays busy after an op of nonzero time, `delta2_s` how long a bus stays busy after a send
    (without delaying its arrival), `bus_Bps` the bus bandwidth (default: the cluster's default link
    bandwidth; per-pair links and latencies are not used by this model).
    """
    return PlacetoSimModel(graph, cluster, delta1_s=delta1_s, delta2_s=delta2_s, bus_Bps=bus_Bps).run(devices)


def reference_form(graph: CompGraph) -> CompGraph:
    """`graph` rewritten the way the reference simulator reads a TensorFlow graph's inputs, so that the
    `placeto` model then reproduces the reference's timing on it (docs/sim-placeto.md, "Input form"):

    1. a control edge (`bytes` 0) becomes a dependency on output 0 of its producer, with output 0's bytes:
       the bytes of the producer's tensor-0 edges when positive, otherwise what `output_bytes` leaves after
       the producer's other output indices (at least 0);
    2. of several edges between one producer and one consumer only the last in edge order is kept.

    Nodes and the order of the kept edges are unchanged. Returns `graph` itself when nothing changes.
    """
    n, n_e = graph.num_nodes, graph.num_edges
    src, dst, tensor, nbytes = graph.edge_src, graph.edge_dst, graph.edge_tensor, graph.edge_bytes
    out0 = np.full(n, np.nan)
    data0 = (tensor == 0) & (nbytes > 0)
    out0[src[data0]] = nbytes[data0]
    other = np.zeros(n)
    first = tensor_groups(graph).first_edge
    first = first[tensor[first] != 0]
    np.add.at(other, src[first], nbytes[first])
    out0 = np.where(np.isnan(out0), np.maximum(graph.output_bytes - other, 0.0), out0)
    control = nbytes == 0
    new_tensor = np.where(control, 0, tensor)
    new_bytes = np.where(control, out0[src], nbytes)
    order, group = _groups(dst, src)  # stable: edge order within a (producer, consumer) pair
    last = np.ones(n_e, dtype=bool)
    last[:-1] = group[1:] != group[:-1]
    keep = np.zeros(n_e, dtype=bool)
    keep[order[last]] = True
    if keep.all() and np.array_equal(new_tensor, tensor) and np.array_equal(new_bytes, nbytes):
        return graph
    edges = []
    for e in np.flatnonzero(keep).tolist():
        rec = graph.edge_record(e)
        rec["bytes"] = float(new_bytes[e])
        rec["tensor"] = int(new_tensor[e])
        edges.append(rec)
    nodes = [graph.node_record(v) for v in range(n)]
    return CompGraph.build(graph.name, nodes, edges, meta=graph.meta)


__all__ = ["DELTA1_S", "DELTA2_S", "PlacetoModel", "reference_form", "simulate_placeto"]
