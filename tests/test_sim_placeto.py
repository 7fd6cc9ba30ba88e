"""The `placeto` simulation model (DESIGN.md section 5, docs/sim-placeto.md): hand-computed cases for each
rule, and the compiled simulator against a plain-Python heapq implementation of the same rules below."""

from __future__ import annotations

import heapq
from itertools import count

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cluster, graph
from devplace.errors import DevplaceError
from devplace.graph import CompGraph
from devplace.sim.placeto import PlacetoModel, reference_form, simulate_placeto

US = 1e-6
BW = 1e9  # 1000 bytes take 1 us


def run(g, c, devs, **kw):
    return simulate_placeto(g, c, np.array(devs, dtype=np.int64), **kw)


def us(values):
    return pytest.approx([x * US for x in values], abs=1e-12)


# --------------------------------------------------------------------------- delta1


def test_device_stays_busy_delta1_after_an_op_of_nonzero_time():
    g = graph([("a", 10 * US), ("b", 10 * US)], [])
    r = run(g, cluster(1, bw=BW), [0, 0])
    assert r.start_s.tolist() == us([0, 15.7])
    assert r.finish_s.tolist() == us([10, 25.7])
    assert r.step_time_s == pytest.approx(31.4 * US)  # the last event is b's delta1 tail
    assert r.model == "placeto-sim"
    assert r.device_busy_s.tolist() == us([20])


def test_an_op_of_zero_time_adds_no_delta1():
    g = graph([("z", 0.0), ("b", 10 * US)], [])
    r = run(g, cluster(1, bw=BW), [0, 0])
    assert r.start_s.tolist() == [0.0, 0.0]
    assert r.finish_s.tolist() == us([0, 10])
    assert r.step_time_s == pytest.approx(15.7 * US)


def test_delta_parameters_and_speed():
    g = graph([("a", 10 * US), ("b", 10 * US)], [])
    r = run(g, cluster(1, bw=BW, speeds=[2.0]), [0, 0], delta1_s=1 * US)
    assert r.start_s.tolist() == us([0, 6])
    assert r.step_time_s == pytest.approx(12 * US)
    assert r.device_busy_s.tolist() == us([10])


# --------------------------------------------------------------------------- the bus


def test_bus_stays_busy_delta2_after_a_send_without_delaying_the_arrival():
    # a's two outputs go to b and c on device 1: sends [10, 11] and, after the 25 us tail, [36, 37]
    g = graph([("a", 10 * US), ("b", 1 * US), ("c", 1 * US)],
              [("a", "b", 1000, 0), ("a", "c", 1000, 1)])
    r = run(g, cluster(2, bw=BW), [0, 1, 1])
    assert r.transfers.start_s.tolist() == us([10, 36])
    assert r.transfers.finish_s.tolist() == us([11, 37])
    assert r.transfers.tensor.tolist() == [0, 1]
    assert r.transfers.dst_dev.tolist() == [-1, -1]
    assert r.transfers.src_dev.tolist() == [0, 0]
    assert r.start_s.tolist() == us([0, 11, 37])  # b does not wait for the 25 us tail
    assert r.step_time_s == pytest.approx(62 * US)  # the second send's tail ends at 37 + 25
    assert r.comm_bytes == 2000


def test_one_outgoing_bus_per_source_device_serializes_sends_to_different_devices():
    g = graph([("a", 10 * US), ("b", 1 * US), ("c", 1 * US)],
              [("a", "b", 1000, 0), ("a", "c", 1000, 1)])
    r = run(g, cluster(3, bw=BW), [0, 1, 2])
    assert r.transfers.start_s.tolist() == us([10, 36])
    assert r.start_s.tolist() == us([0, 11, 37])


def test_a_tensor_consumed_on_two_remote_devices_is_sent_once():
    g = graph([("a", 10 * US), ("b", 1 * US), ("c", 1 * US)],
              [("a", "b", 1000), ("a", "c", 1000)])
    r = run(g, cluster(3, bw=BW), [0, 1, 2])
    assert len(r.transfers) == 1
    assert r.transfers.dst_dev.tolist() == [-1]
    assert r.comm_bytes == 1000
    assert r.start_s.tolist() == us([0, 11, 11])
    assert r.step_time_s == pytest.approx(36 * US)


def test_local_consumers_need_no_send():
    g = graph([("a", 10 * US), ("b", 1 * US)], [("a", "b", 1000)])
    r = run(g, cluster(2, bw=BW), [1, 1])
    assert len(r.transfers) == 0 and r.comm_bytes == 0
    assert r.start_s.tolist() == us([0, 15.7])  # ready at 10, the device is free after delta1


def test_chain_across_devices():
    # a on 0 [0, 10]; send on bus 0 [10, 12] (tail to 37); b on 1 [12, 32]; send on bus 1 [32, 34]
    # (tail to 59); c on 0 [34, 39] (tail to 44.7): the step ends with bus 1's tail
    g = graph([("a", 10 * US), ("b", 20 * US), ("c", 5 * US)], [("a", "b", 2000), ("b", "c", 2000)])
    r = run(g, cluster(2, bw=BW), [0, 1, 0])
    assert r.start_s.tolist() == us([0, 12, 34])
    assert r.finish_s.tolist() == us([10, 32, 39])
    assert r.transfers.node.tolist() == [0, 1]
    assert r.transfers.src_dev.tolist() == [0, 1]
    assert r.step_time_s == pytest.approx(59 * US)
    assert r.device_busy_s.tolist() == us([15, 20])


def test_bus_waits_for_the_producer_of_its_next_send():
    # bus 0 is free at 36 (after a's send) but x's output is ready only at 10 + 5.7 + 50 = 65.7
    g = graph([("a", 10 * US), ("x", 50 * US), ("b", 1 * US), ("y", 1 * US)],
              [("a", "b", 1000), ("x", "y", 1000)])
    r = run(g, cluster(2, bw=BW), [0, 0, 1, 1])
    assert r.transfers.start_s.tolist() == us([10, 65.7])
    assert r.start_s.tolist() == us([0, 15.7, 11, 66.7])


def test_bus_default_bandwidth_is_the_clusters_default_link():
    g = graph([("a", 10 * US), ("b", 1 * US)], [("a", "b", 1000)])
    c = cluster(2, bw=BW, lat=1.0, links={(0, 1): (1.0, 5.0)})  # latency and per-pair links unused
    r = run(g, c, [0, 1])
    assert r.start_s.tolist() == us([0, 11])
    assert run(g, c, [0, 1], bus_Bps=BW / 2).start_s.tolist() == us([0, 12])


# --------------------------------------------------------------------------- equal times


def test_equal_time_dependency_removals_are_ordered_by_producer_then_consumer_id():
    # z and y become ready at 10 on device 0; ("p", "y") < ("p", "z"), so y runs first although z comes
    # first in node and edge order
    g = graph([("p", 10 * US), ("z", 1 * US), ("y", 1 * US)], [("p", "z", 8), ("p", "y", 8)])
    r = run(g, cluster(1, bw=BW), [0, 0, 0])
    assert r.start_s.tolist() == us([0, 22.4, 15.7])


def test_ops_ready_earlier_run_first():
    # q is ready at 0, w at 10 (when p finishes); device 0 is busy with p until 15.7 and then runs q first
    g = graph([("p", 10 * US), ("q", 1 * US), ("w", 1 * US)], [("p", "w", 8)])
    r = run(g, cluster(1, bw=BW), [0, 0, 0])
    assert r.start_s.tolist() == us([0, 15.7, 22.4])



def test_bus_work_comes_before_device_work_at_equal_times():
    # at 1.25 bus 0 delivers a's zero-byte output to w (device 1) and device 1 runs the zero-time z, whose
    # consumer c becomes ready at 1.25 too; the bus goes first, so w is queued before c and runs first
    g = graph([("a", 1.25), ("y", 1.0), ("z", 0.0), ("w", 1.0), ("c", 1.0)],
              [("a", "w", 0), ("y", "z", 1), ("z", "c", 1)])
    r = run(g, cluster(2, bw=1.0), [0, 1, 1, 1, 1], delta1_s=0.25, delta2_s=0.5)
    assert r.transfers.start_s.tolist() == [1.25]
    assert r.start_s.tolist() == [0.0, 0.0, 1.25, 1.25, 2.5]

# --------------------------------------------------------------------------- dependencies and input form


def test_control_edge_is_a_zero_byte_send_of_its_own_output_index():
    # the control edge a -> c (tensor 1, 0 bytes) is a second send on bus 0: it starts after the tail of
    # the first, at 36, and arrives at once
    g = graph([{"id": "a", "compute_s": 10 * US, "output_bytes": 5000}, ("b", 1 * US), ("c", 1 * US)],
              [("a", "b", 1000, 0), ("a", "c", 0, 1)])
    r = run(g, cluster(3, bw=BW), [0, 1, 2])
    assert r.transfers.tensor.tolist() == [0, 1]
    assert r.transfers.nbytes.tolist() == [1000, 0]
    assert r.start_s.tolist() == us([0, 11, 36])


def test_a_consumer_of_two_outputs_of_one_producer_waits_for_both():
    g = graph([("a", 10 * US), ("b", 1 * US)], [("a", "b", 1000, 0), ("a", "b", 3000, 1)])
    r = run(g, cluster(2, bw=BW), [0, 1])
    assert r.transfers.tensor.tolist() == [0, 1]
    assert r.transfers.finish_s.tolist() == us([11, 39])
    assert r.start_s.tolist() == us([0, 39])


def test_reference_form_reads_a_control_edge_as_output_0():
    g = graph([{"id": "a", "compute_s": 10 * US, "output_bytes": 5000}, ("b", 1 * US), ("c", 1 * US)],
              [("a", "b", 1000, 0), ("a", "c", 0, 1)])
    h = reference_form(g)
    assert [h.edge_record(e) for e in range(h.num_edges)] == [{"src": "a", "dst": "b", "bytes": 1000},
                                                              {"src": "a", "dst": "c", "bytes": 1000}]
    r = run(h, cluster(3, bw=BW), [0, 1, 2])
    assert len(r.transfers) == 1 and r.comm_bytes == 1000
    assert r.start_s.tolist() == us([0, 11, 11])


def test_reference_form_charges_a_control_edge_the_rest_of_output_bytes_when_output_0_is_unknown():
    # outputs total 5000 bytes, 1000 of them are tensor 1: output 0 is charged 4000 bytes (4 us)
    g = graph([{"id": "a", "compute_s": 10 * US, "output_bytes": 5000}, ("b", 1 * US), ("c", 1 * US)],
              [("a", "b", 1000, 1), ("a", "c", 0)])
    r = run(reference_form(g), cluster(2, bw=BW), [0, 0, 1])
    assert r.transfers.tensor.tolist() == [0]
    assert r.transfers.nbytes.tolist() == [4000]
    assert r.start_s.tolist() == us([0, 15.7, 14])


def test_reference_form_keeps_only_the_last_edge_of_a_pair():
    nodes = [("a", 10 * US), ("b", 1 * US)]
    r = run(reference_form(graph(nodes, [("a", "b", 1000, 0), ("a", "b", 3000, 1)])), cluster(2, bw=BW), [0, 1])
    assert r.transfers.tensor.tolist() == [1]
    assert r.start_s.tolist() == us([0, 13])
    r = run(reference_form(graph(nodes, [("a", "b", 3000, 1), ("a", "b", 1000, 0)])), cluster(2, bw=BW), [0, 1])
    assert r.transfers.tensor.tolist() == [0]
    assert r.start_s.tolist() == us([0, 11])


def test_reference_form_returns_the_graph_when_nothing_changes():
    g = graph([("a", 1.0), ("b", 1.0)], [("a", "b", 10, 0), ("a", "b", 10, 0)][:1])
    assert reference_form(g) is g


# --------------------------------------------------------------------------- memory


def test_memory_outputs_params_and_temp_on_one_device():
    # a [0, 10], b [15.7, 25.7]; a's output lives [0, 25.7), b's [15.7, 25.7)
    g = graph([{"id": "a", "compute_s": 10 * US, "output_bytes": 100, "param_bytes": 1000, "temp_bytes": 50},
               {"id": "b", "compute_s": 10 * US, "output_bytes": 200, "temp_bytes": 30}], [("a", "b", 100)])
    r = run(g, cluster(2, bw=BW, mem=1330), [0, 0])
    assert r.peak_memory_bytes.tolist() == [1330, 0]
    assert r.feasible
    r = run(g, cluster(2, bw=BW, mem=1329), [0, 0])
    assert not r.feasible and r.oom == {0: 1.0}


def test_memory_output_lives_on_the_producer_until_its_remote_consumer_ends_and_no_receive_buffer():
    # a [0, 10] on 0, send [10, 11], c [11, 21] on 1; d runs [15.7, 16.7] on 0 while a's output is live
    g = graph([{"id": "a", "compute_s": 10 * US, "output_bytes": 100},
               {"id": "d", "compute_s": 1 * US, "temp_bytes": 500},
               {"id": "c", "compute_s": 10 * US, "temp_bytes": 7}], [("a", "c", 1000)])
    r = run(g, cluster(2, bw=BW), [0, 0, 1])
    assert r.start_s.tolist() == us([0, 15.7, 11])
    assert r.peak_memory_bytes.tolist() == [600, 7]


def test_memory_intervals_are_half_open():
    # a's output is freed at 10 when b ends; c (same device, zero time at 10) allocates then: no overlap
    g = graph([{"id": "a", "compute_s": 0.0, "output_bytes": 100},
               {"id": "b", "compute_s": 10 * US},
               {"id": "c", "compute_s": 5 * US, "temp_bytes": 100}], [("a", "b", 1), ("b", "c", 1)])
    r = run(g, cluster(1, bw=BW), [0, 0, 0])
    assert r.start_s.tolist() == us([0, 0, 15.7])
    assert r.peak_memory_bytes.tolist() == [100]


# --------------------------------------------------------------------------- misc


def test_empty_graph_and_parameter_checks():
    g = CompGraph.build("empty", [], [])
    r = run(g, cluster(2, bw=BW), [])
    assert r.step_time_s == 0.0 and len(r.transfers) == 0
    assert r.peak_memory_bytes.tolist() == [0, 0]
    g = graph([("a", 1.0)], [])
    for kw in ({"bus_Bps": 0.0}, {"delta1_s": -1.0}, {"delta2_s": float("nan")}, {"bus_Bps": "fast"}):
        with pytest.raises(DevplaceError):
            run(g, cluster(1), [0], **kw)


def test_deterministic_and_model_reusable():
    g, c, devs, _ = _fixed_case()
    model = PlacetoModel(g, c)
    results = [simulate_placeto(g, c, devs), model.run(devs), model.run(devs.copy())]
    for r in results[1:]:
        assert r.step_time_s == results[0].step_time_s
        for name in ("start_s", "finish_s", "peak_memory_bytes", "device_busy_s"):
            assert np.array_equal(getattr(r, name), getattr(results[0], name))
        for name in ("node", "tensor", "nbytes", "start_s", "finish_s"):
            assert np.array_equal(getattr(r.transfers, name), getattr(results[0].transfers, name))


def _fixed_case():
    rng = np.random.default_rng(7)
    n = 60
    nodes = [{"id": f"n{v:02d}", "compute_s": float(rng.integers(0, 4)) * US,
              "output_bytes": float(rng.integers(0, 5000)), "temp_bytes": float(rng.integers(0, 100))}
             for v in range(n)]
    edges = []
    for j in range(1, n):
        for i in rng.choice(j, size=min(j, 2), replace=False):
            t = int(rng.integers(0, 2))
            edges.append({"src": f"n{i:02d}", "dst": f"n{j:02d}", "bytes": 1000 * (int(i) % 3 + t), "tensor": t})
    g = CompGraph.build("fixed", nodes, edges)
    devs = rng.integers(0, 3, size=n).astype(np.int64)
    return g, cluster(3, bw=BW), devs, edges


# --------------------------------------------------------------------------- plain-Python reference
# The same rules written the way the original simulator is organised: string event kinds whose string
# order is the equal-time order, string keys for dependency removals, per-device heaps keyed by
# (ready time, arrival counter), and a bus that re-queues a send whose producer has not finished.
# With `original_inputs`, the graph is read the way the original reads a TensorFlow graph (a control edge
# is output 0; a children dict per producer, in consumer order, whose value is overwritten so only the
# last edge of a pair counts) -- independently of `reference_form`, which the tests compare it with.


def reference_placeto(g: CompGraph, c, devices, delta1: float, delta2: float, bw: float,
                      original_inputs: bool = False):
    n = g.num_nodes
    ids = g.ids
    dev = [int(d) for d in devices]
    speeds = c.speeds.tolist()
    cost = [float(g.compute_s[v]) / speeds[dev[v]] for v in range(n)]
    size: dict[tuple[int, int], float] = {}
    for e in range(g.num_edges):
        size[(int(g.edge_src[e]), int(g.edge_tensor[e]))] = float(g.edge_bytes[e])

    def output0(u: int) -> float:
        if size.get((u, 0), 0.0) > 0:
            return size[(u, 0)]
        others = sum(b for (p, t), b in size.items() if p == u and t != 0)
        return max(float(g.output_bytes[u]) - others, 0.0)

    # children[u]: (consumer, output index, bytes) in consumer order, then edge order
    children: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
    if original_inputs:
        kids: list[dict[int, tuple[int, float]]] = [{} for _ in range(n)]
        for v in range(n):
            for e in g.in_edges(v):
                u, t, b = int(g.edge_src[e]), int(g.edge_tensor[e]), float(g.edge_bytes[e])
                kids[u][v] = (0, output0(u)) if b == 0 else (t, b)
        for u in range(n):
            children[u] = [(v, t, b) for v, (t, b) in kids[u].items()]
    else:
        for v in range(n):
            for e in g.in_edges(v):
                u = int(g.edge_src[e])
                children[u].append((v, int(g.edge_tensor[e]), float(g.edge_bytes[e])))
    waiting = [0] * n
    for u in range(n):
        for v, _, _ in children[u]:
            waiting[v] += 1

    q: list = []
    ticket = count()
    dev_q: list[list] = [[] for _ in c.devices]
    bus_q: list[list] = [[] for _ in c.devices]
    dev_on = [False] * len(c.devices)
    bus_on = [False] * len(c.devices)
    start = [0.0] * n
    finish = [0.0] * n
    sends = []

    def ready(t: float, v: int) -> None:
        d = dev[v]
        heapq.heappush(dev_q[d], ((t, next(ticket)), v))
        if not dev_on[d]:
            dev_on[d] = True
            heapq.heappush(q, (t, "run_dev", d))

    for v in range(n):
        if waiting[v] == 0:
            ready(0.0, v)
    step = 0.0
    while q:
        t, what, key = heapq.heappop(q)
        step = max(step, t)
        if what == "remove_dependency":
            v = g.index[key[1]]
            waiting[v] -= 1
            if waiting[v] == 0:
                ready(t, v)
        elif what == "run_bus":
            if not bus_q[key]:
                bus_on[key] = False
                continue
            (when, tk), item = heapq.heappop(bus_q[key])
            if when > t:
                heapq.heappush(bus_q[key], ((when, tk), item))
                heapq.heappush(q, (when, "run_bus", key))
                continue
            u, tensor, nbytes, kids_ = item
            arrive = t + nbytes / bw
            sends.append((u, tensor, nbytes, t, arrive))
            for v in kids_:
                heapq.heappush(q, (arrive, "remove_dependency", (ids[u], ids[v], tensor)))
            heapq.heappush(q, (arrive + delta2, "run_bus", key))
        else:
            if not dev_q[key]:
                dev_on[key] = False
                continue
            _, u = heapq.heappop(dev_q[key])
            start[u], finish[u] = t, t + cost[u]
            heapq.heappush(q, (finish[u] + (0.0 if cost[u] == 0 else delta1), "run_dev", key))
            remote: dict[int, tuple[float, list[int]]] = {}
            for v, tensor, nbytes in children[u]:
                if dev[v] == key:
                    heapq.heappush(q, (finish[u], "remove_dependency", (ids[u], ids[v], tensor)))
                else:
                    remote.setdefault(tensor, (nbytes, []))[1].append(v)
            for tensor, (nbytes, kids_) in remote.items():
                heapq.heappush(bus_q[key], ((finish[u], next(ticket)), (u, tensor, nbytes, kids_)))
                if not bus_on[key]:
                    bus_on[key] = True
                    heapq.heappush(q, (finish[u], "run_bus", key))

    # memory: params all step, temp while running, outputs from start to the last consumer's finish
    events = []
    for u in range(n):
        free = max([finish[u]] + [finish[v] for v, _, _ in children[u]])
        for lo, hi, b in ((start[u], free, float(g.output_bytes[u])), (start[u], finish[u], float(g.temp_bytes[u]))):
            if b > 0 and hi > lo:
                events += [(lo, 1, dev[u], b), (hi, 0, dev[u], -b)]
    events.sort(key=lambda x: (x[0], x[1]))
    live = [0.0] * len(c.devices)
    peak = [0.0] * len(c.devices)
    for _, _, d, b in events:
        live[d] += b
        peak[d] = max(peak[d], live[d])
    for u in range(n):
        peak[dev[u]] += float(g.param_bytes[u])
    return step, start, finish, sends, peak


@st.composite
def cases(draw):
    n = draw(st.integers(1, 9))
    num_dev = draw(st.integers(1, 3))
    ids = draw(st.lists(st.text("abxyz", min_size=1, max_size=3), min_size=n, max_size=n, unique=True))
    nodes = [{"id": ids[v], "compute_s": draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
              "output_bytes": draw(st.sampled_from([0, 1, 3, 8])), "param_bytes": draw(st.sampled_from([0, 5])),
              "temp_bytes": draw(st.sampled_from([0, 2]))} for v in range(n)]
    edges = []
    out_size: dict[tuple[int, int], int] = {}
    for j in range(n):
        for i in range(j):
            if draw(st.integers(0, 2)) == 0:
                for t in draw(st.lists(st.integers(0, 2), min_size=1, max_size=2, unique=True)):
                    b = out_size.setdefault((i, t), draw(st.sampled_from([0, 0, 1, 2, 4])))
                    edges.append({"src": ids[i], "dst": ids[j], "bytes": b, "tensor": t})
    edges = draw(st.permutations(edges))
    g = CompGraph.build("h", nodes, edges)
    c = cluster(num_dev, bw=draw(st.sampled_from([1.0, 2.0])),
                speeds=draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=num_dev, max_size=num_dev)))
    devs = np.array(draw(st.lists(st.integers(0, num_dev - 1), min_size=n, max_size=n)), dtype=np.int64)
    params = draw(st.sampled_from([{"delta1_s": 0.25, "delta2_s": 0.5}, {"delta1_s": 0.0, "delta2_s": 0.0},
                                   {"delta1_s": 5.7e-6, "delta2_s": 25e-6, "bus_Bps": 0.7}]))
    return g, c, devs, params


def _compare(r, g, c, devs, expected):
    step, start, finish, sends, peak = expected
    assert r.step_time_s == step
    assert r.start_s.tolist() == start
    assert r.finish_s.tolist() == finish
    got = list(zip(r.transfers.node.tolist(), r.transfers.tensor.tolist(), r.transfers.nbytes.tolist(),
                   r.transfers.start_s.tolist(), r.transfers.finish_s.tolist(), strict=True))
    assert got == sends
    assert r.transfers.src_dev.tolist() == [int(devs[u]) for u, *_ in sends]
    assert r.transfers.dst_dev.tolist() == [-1] * len(sends)
    assert r.comm_bytes == pytest.approx(sum(s[2] for s in sends))
    assert r.peak_memory_bytes.tolist() == pytest.approx(peak, abs=1e-9)
    assert r.device_busy_s.tolist() == pytest.approx(
        [sum(float(g.compute_s[v]) / c.speeds[d] for v in range(g.num_nodes) if devs[v] == d)
         for d in range(c.num_devices)])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_plain_python_reference(case):
    g, c, devs, params = case
    bw = params.get("bus_Bps", c.link.bandwidth_Bps)
    _compare(simulate_placeto(g, c, devs, **params), g, c, devs,
             reference_placeto(g, c, devs, params["delta1_s"], params["delta2_s"], bw))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_reference_form_matches_the_originals_input_conversion(case):
    g, c, devs, params = case
    bw = params.get("bus_Bps", c.link.bandwidth_Bps)
    _compare(simulate_placeto(reference_form(g), c, devs, **params), g, c, devs,
             reference_placeto(g, c, devs, params["delta1_s"], params["delta2_s"], bw, original_inputs=True))
