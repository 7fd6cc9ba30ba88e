"""The `devplace` simulation model: one hand-computed case per rule of DESIGN.md section 4, and the
compiled simulator against the plain-Python reference in reference_sim.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cluster, graph
from devplace.errors import DevplaceError, PlacementError
from devplace.graph import Placement
from devplace.sim import DevplaceModel, lower_bound, simulate
from devplace.sim.bounds import memory_lower_bound
from reference_sim import reference_simulate


def run(g, c, devs):
    return simulate(g, c, np.array(devs))


def test_chain_across_two_devices_pays_latency_plus_bytes_over_bandwidth():
    g = graph([("a", 1.0), ("b", 2.0)], [("a", "b", 10)])
    r = run(g, cluster(bw=10.0, lat=0.5), [0, 1])
    assert r.finish_s.tolist() == [1.0, 4.5]  # transfer [1, 2.5], b [2.5, 4.5]
    assert r.start_s.tolist() == [0.0, 2.5]
    assert r.step_time_s == 4.5
    assert r.comm_bytes == 10
    assert (r.transfers.start_s.tolist(), r.transfers.finish_s.tolist()) == ([1.0], [2.5])


def test_one_channel_is_fifo():
    # a sends 20 bytes (2 s) at t=1; b finishes at 2 and its 10 bytes wait until the channel frees at 3
    g = graph([("a", 1.0), ("b", 1.0), ("x", 1.0), ("y", 1.0)], [("a", "x", 20), ("b", "y", 10)])
    r = run(g, cluster(bw=10.0), [0, 0, 1, 1])
    assert r.transfers.start_s.tolist() == [1.0, 3.0]
    assert r.transfers.finish_s.tolist() == [3.0, 4.0]
    assert r.start_s.tolist() == [0.0, 1.0, 3.0, 4.0]
    assert r.step_time_s == 5.0


def test_channels_of_different_pairs_run_in_parallel():
    g = graph([("a", 1.0), ("b", 1.0), ("c", 1.0)], [("a", "b", 10), ("a", "c", 10)])
    r = run(g, cluster(3, bw=10.0), [0, 1, 2])
    assert r.transfers.start_s.tolist() == [1.0, 1.0]
    assert r.start_s.tolist() == [0.0, 2.0, 2.0]
    assert r.step_time_s == 3.0


def test_full_duplex_opposite_directions_do_not_wait():
    g = graph([("a", 1.0), ("b", 1.0), ("x", 1.0), ("y", 1.0)], [("a", "x", 10), ("b", "y", 10)])
    r = run(g, cluster(bw=10.0), [0, 1, 1, 0])
    assert sorted(r.transfers.start_s.tolist()) == [1.0, 1.0]
    assert r.step_time_s == 3.0


def test_one_transfer_per_tensor_and_device_with_several_consumers():
    g = graph([("a", 1.0), ("b", 1.0), ("c", 1.0)], [("a", "b", 10), ("a", "c", 10)])
    r = run(g, cluster(bw=10.0), [0, 1, 1])
    assert len(r.transfers) == 1
    assert r.comm_bytes == 10
    assert r.start_s.tolist() == [0.0, 2.0, 3.0]


def test_two_tensors_to_one_device_are_two_transfers_in_tensor_order():
    # edges listed tensor 1 first; the transfer of tensor 0 still goes first (rule 3)
    g = graph([("a", 1.0), ("b", 1.0)], [("a", "b", 30, 1), ("a", "b", 10, 0)])
    r = run(g, cluster(bw=10.0), [0, 1])
    assert r.transfers.tensor.tolist() == [0, 1]
    assert r.transfers.finish_s.tolist() == [2.0, 5.0]
    assert r.start_s[1] == 5.0


def test_same_time_transfers_are_served_by_rank():
    # a finishes at 1 and z (0 s, after a) also at 1 on gpu0; both send to gpu1 at t=1: a (rank 0) first
    g = graph([("a", 1.0), ("z", 0.0), ("p", 1.0), ("q", 1.0)],
              [("a", "z", 0, 1), ("z", "q", 10), ("a", "p", 20)])
    r = run(g, cluster(bw=10.0), [0, 0, 1, 1])
    order = [g.ids[v] for v in r.transfers.node.tolist()]
    assert order == ["a", "z"]
    assert r.transfers.start_s.tolist() == [1.0, 3.0]


def test_control_edge_costs_latency_only():
    g = graph([("a", 1.0), ("b", 1.0)], [("a", "b", 0)])
    r = run(g, cluster(bw=10.0, lat=0.25), [0, 1])
    assert r.start_s[1] == 1.25
    assert r.comm_bytes == 0


def test_per_pair_link_overrides_default():
    g = graph([("a", 1.0), ("b", 1.0)], [("a", "b", 10)])
    c = cluster(bw=10.0, links={(0, 1): (100.0, 0.0)})
    assert run(g, c, [0, 1]).start_s[1] == 1.1
    assert run(g, c, [1, 0]).start_s[1] == 2.0  # reverse direction keeps the default


def test_heterogeneous_speeds_scale_compute():
    g = graph([("a", 2.0), ("b", 2.0)], [])
    r = run(g, cluster(speeds=[1.0, 4.0]), [0, 1])
    assert r.finish_s.tolist() == [2.0, 0.5]
    assert r.device_busy_s.tolist() == [2.0, 0.5]


def test_ready_queue_prefers_earlier_ready_time_then_rank():
    # on gpu0: s runs [0,2]; r1 ready at 1 (after x on gpu1 and a transfer), k ready at 2 (after s).
    # k has the smaller rank but r1 was ready first, so r1 runs first
    g = graph([("s", 2.0), ("x", 0.5), ("k", 1.0), ("r1", 1.0)], [("s", "k", 0), ("x", "r1", 5)])
    r = run(g, cluster(bw=10.0), [0, 1, 0, 0])
    assert g.topo_rank[g.index["k"]] < g.topo_rank[g.index["r1"]]
    assert r.start_s[g.index["r1"]] == 2.0
    assert r.start_s[g.index["k"]] == 3.0


def test_ready_queue_breaks_equal_ready_times_by_rank():
    g = graph([("a", 1.0), ("c", 1.0), ("b", 1.0)], [("a", "b", 0), ("a", "c", 0)])
    # rank: a, b, c (Kahn follows edge order a->b before a->c), all on one device
    r = run(g, cluster(1), [0, 0, 0])
    assert r.start_s[g.index["b"]] == 1.0
    assert r.start_s[g.index["c"]] == 2.0


def test_memory_frees_before_allocations_at_equal_times():
    # a (out 100) -> b (out 50) -> c (out 100), one device. During b: 150. At t=2 a's output is freed
    # before c allocates, so the peak stays 150, not 250.
    g = graph([{"id": "a", "compute_s": 1, "output_bytes": 100}, {"id": "b", "compute_s": 1, "output_bytes": 50},
               {"id": "c", "compute_s": 1, "output_bytes": 100}], [("a", "b", 100), ("b", "c", 50)])
    r = run(g, cluster(1), [0, 0, 0])
    assert r.peak_memory_bytes.tolist() == [150.0]


def test_zero_length_intervals_hold_nothing():
    g = graph([{"id": "a", "compute_s": 0, "output_bytes": 10**6, "temp_bytes": 10**6}], [])
    r = run(g, cluster(1), [0])
    assert r.peak_memory_bytes.tolist() == [0.0]


def test_memory_counts_params_temps_and_received_tensors():
    g = graph([{"id": "a", "compute_s": 1, "output_bytes": 40, "param_bytes": 1000, "temp_bytes": 7},
               {"id": "b", "compute_s": 1, "output_bytes": 3, "param_bytes": 500}], [("a", "b", 40)])
    r = run(g, cluster(bw=10.0), [0, 1])
    # gpu0: params 1000 + a's output 40 + temp 7 while a runs; gpu1: params 500 + received 40 + b's 3
    assert r.peak_memory_bytes.tolist() == [1047.0, 543.0]


def test_oom_reports_devices_and_excess():
    g = graph([{"id": "a", "compute_s": 1, "param_bytes": 150}, {"id": "b", "compute_s": 1, "param_bytes": 10}], [])
    r = run(g, cluster(mem=100), [0, 1])
    assert not r.feasible
    assert r.oom == {0: 50.0}
    assert r.to_dict()["oom"] == {"0": 50.0}


def test_placement_object_and_errors():
    g = graph([("a", 1.0), ("b", 1.0)], [("a", "b", 1)])
    c = cluster()
    assert simulate(g, c, Placement({"a": 0, "b": 1})).step_time_s == pytest.approx(2.1)
    with pytest.raises(PlacementError, match="no device for 1 node"):
        simulate(g, c, Placement({"a": 0}))
    with pytest.raises(PlacementError, match="not in graph"):
        simulate(g, c, Placement({"a": 0, "b": 0, "zz": 1}))
    with pytest.raises(PlacementError, match=r"devices 0\.\.1"):
        simulate(g, c, Placement({"a": 0, "b": 2}))
    with pytest.raises(DevplaceError, match="unknown simulation model"):
        simulate(g, c, [0, 0], model="tf")


# ----------------------------------------------------------------------------- random cases

@st.composite
def cases(draw, max_nodes: int = 14, max_devices: int = 3):
    n = draw(st.integers(1, max_nodes))
    nd = draw(st.integers(1, max_devices))
    nums = st.sampled_from([0, 0.5, 1, 1.5, 2, 3])
    nodes = [{"id": f"n{i}", "compute_s": draw(nums), "output_bytes": draw(st.sampled_from([0, 4, 8, 16])),
              "param_bytes": draw(st.sampled_from([0, 5])), "temp_bytes": draw(st.sampled_from([0, 2]))}
             for i in range(n)]
    perm = draw(st.permutations(range(n)))  # insertion order differs from the DAG's order
    edges, seen, size = [], set(), {}
    for _ in range(draw(st.integers(0, 3 * n))):
        i, j = sorted(draw(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))))
        tensor = draw(st.integers(0, 1))
        if i == j or (i, j, tensor) in seen:
            continue
        seen.add((i, j, tensor))
        b = size.setdefault((i, tensor), draw(st.sampled_from([0, 1, 10, 25])))
        edges.append({"src": f"n{perm[i]}", "dst": f"n{perm[j]}", "bytes": b, "tensor": tensor})
    speeds = [draw(st.sampled_from([1.0, 2.0, 0.5])) for _ in range(nd)]
    bw = {(a, b): draw(st.sampled_from([5.0, 10.0, 20.0])) for a in range(nd) for b in range(nd) if a != b}
    lat = {(a, b): draw(st.sampled_from([0.0, 0.25])) for a in range(nd) for b in range(nd) if a != b}
    placement = [draw(st.integers(0, nd - 1)) for _ in range(n)]
    return nodes, edges, speeds, bw, lat, placement


def build(case):
    nodes, edges, speeds, bw, lat, placement = case
    g = graph(nodes, edges)
    c = cluster(len(speeds), speeds=speeds, links={k: (bw[k], lat[k]) for k in bw})
    return g, c, np.array([placement[int(nid[1:])] for nid in g.ids])


@settings(max_examples=300, deadline=None)
@given(cases())
def test_compiled_simulator_matches_plain_python_reference(case):
    nodes, edges, speeds, bw, lat, _ = case
    g, c, devs = build(case)
    r = simulate(g, c, devs)
    ref = reference_simulate(nodes, edges, speeds, {k: (bw[k], lat[k]) for k in bw},
                             {nid: int(devs[g.index[nid]]) for nid in g.ids})
    assert r.step_time_s == ref.step_time_s
    assert r.start_s.tolist() == [ref.start[nid] for nid in g.ids]
    assert r.finish_s.tolist() == [ref.finish[nid] for nid in g.ids]
    assert r.peak_memory_bytes.tolist() == ref.peak
    assert r.comm_bytes == ref.comm_bytes
    got = sorted(zip([g.ids[v] for v in r.transfers.node], r.transfers.tensor.tolist(), r.transfers.dst_dev.tolist(),
                     r.transfers.start_s.tolist(), r.transfers.finish_s.tolist(), strict=True))
    assert got == sorted(ref.transfers)


@settings(max_examples=100, deadline=None)
@given(cases())
def test_step_time_is_at_least_the_lower_bound_and_deterministic(case):
    g, c, devs = build(case)
    r = simulate(g, c, devs)
    assert r.step_time_s >= lower_bound(g, c).value_s - 1e-12
    r2 = simulate(g, c, devs)
    assert r2.to_dict(g.ids, per_op=True) == r.to_dict(g.ids, per_op=True)


@settings(max_examples=200, deadline=None)
@given(cases(), st.data())
def test_the_memory_lower_bound_is_below_the_simulated_peaks_of_every_placement(case, data):
    g, c, devs = build(case)
    r = simulate(g, c, devs)
    b = memory_lower_bound(g, c)
    assert b.total_bytes <= r.peak_memory_bytes.sum() * (1 + 1e-12)  # at one instant, over all devices
    if b.op >= 0:
        assert b.op_bytes <= r.peak_memory_bytes[devs[b.op]] * (1 + 1e-12)
    # tie classes drawn at random, each class on one device (its parameters count where any of its ops runs)
    classes = np.array(data.draw(st.lists(st.integers(0, 2), min_size=g.num_nodes, max_size=g.num_nodes)))
    _, classes = np.unique(classes, return_inverse=True)
    on = np.array(data.draw(st.lists(st.integers(0, c.num_devices - 1), min_size=3, max_size=3)))
    tied = on[classes]
    r = simulate(g, c, tied)
    b = memory_lower_bound(g, c, classes)
    assert b.total_bytes <= r.peak_memory_bytes.sum() * (1 + 1e-12)
    if b.op >= 0:
        assert b.op_bytes <= r.peak_memory_bytes[tied[b.op]] * (1 + 1e-12)


def test_the_memory_lower_bound_counts_the_stash_at_the_start_of_the_backward():
    # f0 -> f1 -> b1 -> b0, each backward reading its forward op's output: when b1 starts, f0's and f1's outputs
    # are held somewhere whatever the placement, beside every parameter
    g = graph([{"id": "f0", "kind": "forward", "compute_s": 1, "output_bytes": 8, "param_bytes": 5},
               {"id": "f1", "kind": "forward", "compute_s": 1, "output_bytes": 16, "param_bytes": 5},
               {"id": "b1", "kind": "backward", "compute_s": 1, "output_bytes": 4},
               {"id": "b0", "kind": "backward", "compute_s": 1, "output_bytes": 4}],
              [{"src": "f0", "dst": "f1", "bytes": 8}, {"src": "f1", "dst": "b1", "bytes": 16},
               {"src": "b1", "dst": "b0", "bytes": 4}, {"src": "f0", "dst": "b0", "bytes": 8}])
    b = memory_lower_bound(g, cluster(2))
    assert b.params_bytes == 10
    assert b.total_bytes == 10 + 8 + 16 + 4  # at b1's start: f0's, f1's and b1's own output
    assert b.why_not(g, cluster(2, mem=29.0)) is None  # f1 holds 29 when it starts: 5 + 8 + 16
    assert "lower bound on memory is 38 B" in b.why_not(g, cluster(2, mem=18.0))


@settings(max_examples=100, deadline=None)
@given(cases())
def test_all_on_one_unit_speed_device_takes_the_sum_of_compute(case):
    nodes, edges, *_ = case
    g = graph(nodes, edges)
    r = simulate(g, cluster(2, lat=0.0), np.zeros(g.num_nodes, dtype=np.int64))
    assert r.step_time_s == pytest.approx(float(g.compute_s.sum()))
    assert len(r.transfers) == 0
    # the device never idles while work remains: ops run back to back
    assert r.device_busy_s.tolist()[0] == pytest.approx(r.step_time_s)


def test_lower_bound_parts():
    g = graph([("a", 1.0), ("b", 4.0), ("c", 1.0)], [("a", "b", 0)])
    lb = lower_bound(g, cluster(2, speeds=[1.0, 2.0]))
    assert lb.work_s == pytest.approx(6.0 / 3.0)
    assert lb.critical_path_s == pytest.approx(2.5)
    assert [g.ids[v] for v in lb.critical_path] == ["a", "b"]
    assert lb.value_s == 2.5 and lb.limited_by == "critical path"


@settings(max_examples=100, deadline=None)
@given(cases(), st.randoms(use_true_random=False))
def test_active_mask_simulates_the_induced_subgraph(case, rnd):
    # the masked run keeps the full graph's ranks, so the reference gets them explicitly
    _, _, speeds, bw, lat, _ = case
    g, c, devs = build(case)
    keep = [rnd.random() < 0.6 for _ in range(g.num_nodes)]
    kept = {g.ids[v] for v in range(g.num_nodes) if keep[v]}
    sub_nodes = [g.node_record(v) for v in range(g.num_nodes) if keep[v]]
    sub_edges = [g.edge_record(e) for e in range(g.num_edges)
                 if g.ids[g.edge_src[e]] in kept and g.ids[g.edge_dst[e]] in kept]
    masked = DevplaceModel(g, c).run(devs, active=np.array(keep))
    ref = reference_simulate(sub_nodes, sub_edges, speeds, {k: (bw[k], lat[k]) for k in bw},
                             {nid: int(devs[g.index[nid]]) for nid in kept},
                             rank={nid: int(g.topo_rank[g.index[nid]]) for nid in kept})
    assert masked.step_time_s == ref.step_time_s
    assert masked.peak_memory_bytes.tolist() == ref.peak
    assert {nid: masked.start_s[g.index[nid]] for nid in kept} == ref.start


@settings(max_examples=100, deadline=None)
@given(cases(), st.booleans())
def test_activation_bytes_at_the_peak_are_the_live_forward_outputs(case, all_backward):
    # of each device's peak, the live part is outputs (kept or received) and temps; outputs of forward ops
    # (kind "forward" or none) count as activations, of backward ops not
    nodes, edges, speeds, bw, lat, placement = case
    if all_backward:
        case = ([{**n, "kind": "backward"} for n in nodes], edges, speeds, bw, lat, placement)
    g, c, devs = build(case)
    r = simulate(g, c, devs)
    live = r.peak_memory_bytes - np.bincount(devs, weights=g.param_bytes, minlength=c.num_devices)
    assert r.peak_activation_bytes is not None
    if all_backward:
        assert r.peak_activation_bytes.tolist() == [0.0] * c.num_devices
    elif not g.temp_bytes.any():
        assert r.peak_activation_bytes.tolist() == pytest.approx(live.tolist())
    assert (r.peak_activation_bytes <= live + 1e-9).all()
