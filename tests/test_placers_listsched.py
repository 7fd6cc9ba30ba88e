"""m-ETF, m-SCT and HEFT on examples computed by hand (in the comments), plus memory and determinism.

Conventions of the hand computations: `cluster()` from conftest has zero latency and 10 bytes/s links
unless stated, so a tensor of B bytes takes B / 10 s to cross; op times are `compute_s` on speed-1 devices.
Topological ranks follow the canonical order (Kahn, FIFO, sources in insertion order).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cluster, graph
from devplace.graph import CompGraph
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.placers import NoFitError, PlacerError, place
from devplace.placers.heft import heft_priority
from devplace.placers.list_scheduling import ListScheduler
from devplace.placers.m_etf import order_keys
from devplace.placers.m_sct import favourite_children, lp_relaxation
from devplace.sim import simulate
from devplace.zoo import layered_graph

LIST_PLACERS = ("m-etf", "m-sct", "heft")


def devices_of(p) -> dict[str, int]:
    return dict(p.assignment)


def fork_join(nbytes: float):
    # a(1) -> b(2), a -> c(2), b -> d(1), c -> d; every edge carries `nbytes`
    return graph([("a", 1), ("b", 2), ("c", 2), ("d", 1)],
                 [("a", "b", nbytes), ("a", "c", nbytes), ("b", "d", nbytes), ("c", "d", nbytes)])


# ----------------------------------------------------------------------------- m-ETF


def test_etf_splits_a_fork_join_when_communication_is_cheap():
    # 1-byte tensors: 0.1 s per transfer.
    # t=0: a is the only ready op; both devices could start it at 0 -> device 0 (lower index), runs [0, 1].
    # t=1: b and c are ready. Device 0 has their inputs at 1, device 1 only at 1.1. Device 0 proposes b
    #      (rank 1 < rank 2); device 1 proposes nothing yet. b on 0, [1, 3].
    # t=1.1: c's input reaches device 1 -> c on 1, [1.1, 3.1].
    # t=3.1: d ready (c finished). Inputs on 0: b at 3, c at 3.1 + 0.1 = 3.2; on 1: b at 3 + 0.1 = 3.1,
    #      c at 3.1 -> device 1 can start it now: d on 1, [3.1, 4.1]. The simulator agrees: 4.1 s.
    g = fork_join(1.0)
    c = cluster(2, bw=10.0)
    p = place(g, c, placer="m-etf")
    assert devices_of(p) == {"a": 0, "b": 0, "c": 1, "d": 1}
    assert p.meta["step_time_s"] == pytest.approx(4.1)
    sched = ListScheduler(g, c).event(order_keys(g.topo_order))
    assert sched.start_s.tolist() == pytest.approx([0.0, 1.0, 1.1, 3.1])
    assert sched.makespan_s == pytest.approx(4.1)


def test_etf_keeps_a_fork_join_on_one_device_when_communication_is_expensive():
    # 30-byte tensors: 3 s per transfer.
    # t=0: a on 0, [0, 1]. t=1: b on 0 (inputs there), [1, 3]; c could start on device 1 only at 4.
    # t=3: device 0 is free and c's input is there since 1 -> c on 0, [3, 5] (device 1 would wait to 4).
    # t=5: d on 0 (both inputs local), [5, 6]. Everything on device 0, 6 s = the serial time.
    g = fork_join(30.0)
    p = place(g, cluster(2, bw=10.0), placer="m-etf")
    assert set(devices_of(p).values()) == {0}
    assert p.meta["step_time_s"] == pytest.approx(6.0)


def test_etf_is_earliest_start_not_earliest_finish():
    # Independent x(4) and a(2) on devices of speed 1 and 4 (placers see the fast one first, `canonical_order`):
    # x goes to the fast device [0, 1]. Then a could start at 0 on the slow device (finish 2) or at 1 on the fast
    # one (finish 1.5): m-ETF (earliest *start*) takes the slow one, HEFT (earliest *finish*) the fast one.
    g = graph([("x", 4), ("a", 2)], [])
    c = cluster(2, speeds=[1.0, 4.0])
    assert devices_of(place(g, c, placer="m-etf", order="topo")) == {"x": 1, "a": 0}
    assert devices_of(place(g, c, placer="heft", order="topo")) == {"x": 1, "a": 1}


def test_etf_uses_the_order_as_its_tie_break():
    # Three independent ops s1(1), s2(2), s3(3) on 2 devices: at t=0 all can start anywhere.
    # order topo (s1, s2, s3): s1 -> 0, s2 -> 1; t=1: device 0 is free -> s3 on 0.
    # order reversed-topo (s3, s2, s1): s3 -> 0, s2 -> 1; t=2: device 1 is free first -> s1 on 1.
    g = graph([("s1", 1), ("s2", 2), ("s3", 3)], [])
    c = cluster(2)
    assert devices_of(place(g, c, placer="m-etf", order="topo")) == {"s1": 0, "s2": 1, "s3": 0}
    assert devices_of(place(g, c, placer="m-etf", order="reversed-topo")) == {"s3": 0, "s2": 1, "s1": 1}


def test_transfers_on_one_channel_queue_behind_each_other():
    # u1(1) and u2(1) both hold 11 kB of parameters: only device 0 (25 kB) holds them, device 1 has 10 kB.
    # w (5 kB of parameters) then fits only on device 1. u1 runs [0, 1], u2 [1, 2]. w's inputs cross
    # channel (0, 1) in producer-finish order: u1's 30 bytes [1, 4], then u2's 10 bytes at
    # max(2, 4) = 4 -> 5. So w starts at 5, not at max(4, 3) = 4 as without contention; the simulator
    # gives the same 5 + 1 = 6 s.
    g = graph([{"id": "u1", "compute_s": 1, "param_bytes": 11e3}, {"id": "u2", "compute_s": 1, "param_bytes": 11e3},
               {"id": "w", "compute_s": 1, "param_bytes": 5e3}],
              [("u1", "w", 30.0), ("u2", "w", 10.0)])
    c = Cluster("c", (Device("g0", 25e3), Device("g1", 10e3)), Link(10.0))
    sched = ListScheduler(g, c).event(order_keys(g.topo_order))
    assert sched.devices.tolist() == [0, 0, 1]
    assert sched.start_s.tolist() == pytest.approx([0.0, 1.0, 5.0])
    p = place(g, c, placer="m-etf")
    assert p.meta["step_time_s"] == pytest.approx(6.0)


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("name", LIST_PLACERS)
def test_a_device_without_room_is_skipped(name):
    # One op with 10 bytes of parameters: device 0 (the tie-break's choice) holds 5, device 1 holds 20.
    g = graph([{"id": "a", "compute_s": 1, "param_bytes": 10}], [])
    c = Cluster("c", (Device("g0", 5), Device("g1", 20)), Link(10.0))
    assert devices_of(place(g, c, placer=name)) == {"a": 1}


@pytest.mark.parametrize("name", LIST_PLACERS)
def test_an_op_that_fits_on_no_device_raises(name):
    # 10 bytes of parameters in one op; two devices of 8 bytes (16 in all, so the total alone would fit).
    g = graph([{"id": "a", "compute_s": 1, "param_bytes": 10}, {"id": "b", "compute_s": 1}], [("b", "a", 1.0)])
    c = Cluster("c", (Device("g0", 8), Device("g1", 8)), Link(10.0))
    with pytest.raises(NoFitError, match=r"fit on no device.*needs about"):
        place(g, c, placer=name)


@pytest.mark.parametrize("name", LIST_PLACERS)
def test_outputs_are_freed_once_their_consumers_are_done(name):
    # A chain a -> b -> c with 1-byte outputs on one device of 2 bytes: b needs its input (1) and its output
    # (1); once b is done a's output is freed, so c fits again (1 + 1). Without freeing, c would need 3.
    g = graph([{"id": x, "compute_s": 1, "output_bytes": 1} for x in "abc"], [("a", "b", 1.0), ("b", "c", 1.0)])
    c = Cluster("c", (Device("g0", 2),), Link(10.0))
    p = place(g, c, placer=name)
    assert set(devices_of(p).values()) == {0}
    assert simulate(g, c, p).feasible


def test_the_list_schedule_avoids_devices_that_fill_up():
    # Tight memory: the parameters of a layered graph take 85% of four devices. m-ETF still places it,
    # feasibly, using every device.
    g = layered_graph(400, width=8, seed=3)
    mem = float(g.param_bytes.sum()) / 4 / 0.85
    c = Cluster("c", tuple(Device(f"g{i}", mem) for i in range(4)), Link(12e9, 1e-5))
    for name in ("m-etf", "m-sct"):
        p = place(g, c, placer=name)
        r = simulate(g, c, p)
        assert r.feasible and len(set(devices_of(p).values())) == 4


# ----------------------------------------------------------------------------- HEFT


def test_heft_insertion_fills_an_idle_gap():
    # a(1), b(3) sources; x(5) <- a (50 B = 5 s across), x <- b (10 B = 1 s); y(1) <- a (50 B).
    # Upward ranks (2 devices: mean comm = bytes / 10): x = 5, y = 1, a = 1 + max(5 + 5, 5 + 1) = 11,
    # b = 3 + 1 + 5 = 9. HEFT order: a, b, x, y.
    # a: finish 1 on either device -> 0, [0, 1]. b: device 0 would finish at 4, device 1 at 3 -> 1, [0, 3].
    # x: on 0 its inputs are there at max(1, 3 + 1) = 4 -> finish 9; on 1 at max(1 + 5, 3) = 6 -> 11 -> 0, [4, 9].
    # Device 0 is idle in [1, 4]. y's input is on device 0 at 1:
    #   insertion: y fits in the gap, [1, 2] on device 0 (device 1: 1 + 5 = 6 -> finish 7);
    #   no insertion: device 0 is free only at 9 -> finish 10, so device 1 (finish 7) wins.
    g = graph([("a", 1), ("b", 3), ("x", 5), ("y", 1)], [("a", "x", 50.0), ("b", "x", 10.0), ("a", "y", 50.0)])
    c = cluster(2, bw=10.0)
    assert heft_priority(g, c).tolist() == [0, 1, 2, 3]
    sched = ListScheduler(g, c).heft(heft_priority(g, c), insertion=True)
    assert sched.devices.tolist() == [0, 1, 0, 0]
    assert sched.start_s.tolist() == pytest.approx([0.0, 0.0, 4.0, 1.0])
    assert devices_of(place(g, c, placer="heft")) == {"a": 0, "b": 1, "x": 0, "y": 0}
    assert devices_of(place(g, c, placer="heft", insertion=False)) == {"a": 0, "b": 1, "x": 0, "y": 1}


def test_heft_ignores_the_order():
    g = layered_graph(60, width=4, seed=1)
    c = cluster(3, bw=1e9, lat=1e-5)
    placements = {o: place(g, c, placer="heft", order=o).assignment for o in ("topo", "bfs", "random")}
    assert placements["topo"] == placements["bfs"] == placements["random"]


# ----------------------------------------------------------------------------- m-SCT


def test_sct_lp_on_a_fork_picks_the_expensive_edge_as_favourite():
    # a(1) -> b(1) with 50 B (c = 5 s), a -> c(1) with another tensor of 10 B (c = 1 s); 2 devices, p = compute.
    # LP: at most one favourite child: x_ab + x_ac >= 1. w = max(1 + 5 x_ab + 1, 1 + x_ac + 1).
    # With x_ac = 1 - x_ab: 2 + 5 t = 3 - t at t = 1/6, so x_ab = 1/6, x_ac = 5/6, w = 2 + 5/6.
    # Rounding at 0.5: a -> b is the favourite edge.
    g = graph([("a", 1), ("b", 1), ("c", 1)], [("a", "b", 50.0), ("a", "c", 10.0, 1)])
    c = cluster(2, bw=10.0)
    pu, pv, x, w = lp_relaxation(g, c)
    assert (pu.tolist(), pv.tolist()) == ([0, 0], [1, 2])
    assert x.tolist() == pytest.approx([1 / 6, 5 / 6], abs=1e-6)
    assert w == pytest.approx(2 + 5 / 6, rel=1e-6)
    assert favourite_children(g, c, 0.5).tolist() == [1, -1, -1]
    # at threshold 0.1 no edge is favourite (1/6 > 0.1)
    assert favourite_children(g, c, 0.1).tolist() == [-1, -1, -1]


def test_sct_lp_on_a_join_picks_one_favourite_parent():
    # a(1) -> c(1) with 50 B, b(1) -> c with 10 B: at most one favourite parent, x_ac + x_bc >= 1;
    # symmetric to the fork: x_ac = 1/6, x_bc = 5/6, so a's favourite child is c and b has none.
    g = graph([("a", 1), ("b", 1), ("c", 1)], [("a", "c", 50.0), ("b", "c", 10.0)])
    assert favourite_children(g, cluster(2, bw=10.0), 0.5).tolist() == [2, -1, -1]


def test_sct_keeps_the_device_for_the_favourite_child():
    # Sources a(1), y(3), x(2) (ranks 0, 1, 2); a -> b(10) with 50 B (5 s). The critical path a -> b forces
    # x_ab = 0 in the LP: b is a's favourite child.
    # m-ETF: t=0: a on 0 [0, 1], y on 1 [0, 3]. t=1: on device 0 both x (rank 2) and b (rank 3) could start;
    #   x wins the tie-break, [1, 3]; b then starts on 0 at 3 (device 1 would wait for the 5 s transfer):
    #   [3, 13]. Step 13 s.
    # m-SCT: t=1: device 0 ran a, and b starts earliest on device 0 (1, against 6 on device 1): device 0
    #   waits for b and runs only urgent ops. x's urgent time is its latest earliest start, 3 on the busy
    #   device 1, > 1: not urgent. b on 0 [1, 11]; x on 1 when y is done, [3, 5]. Step 11 s.
    g = graph([("a", 1), ("y", 3), ("x", 2), ("b", 10)], [("a", "b", 50.0)])
    c = cluster(2, bw=10.0)
    assert favourite_children(g, c, 0.5).tolist() == [3, -1, -1, -1]
    etf = place(g, c, placer="m-etf", order="topo")
    sct = place(g, c, placer="m-sct", order="topo")
    assert devices_of(etf) == {"a": 0, "y": 1, "x": 0, "b": 0}
    assert devices_of(sct) == {"a": 0, "y": 1, "x": 1, "b": 0}
    assert etf.meta["step_time_s"] == pytest.approx(13.0)
    assert sct.meta["step_time_s"] == pytest.approx(11.0)


def test_sct_without_the_lp_is_etf():
    g = layered_graph(200, width=8, seed=4)
    c = cluster(3, bw=1e9, lat=1e-5)
    etf = place(g, c, placer="m-etf", order="topo")
    assert place(g, c, placer="m-sct", order="topo", max_lp_nodes=0).assignment == etf.assignment


def test_sct_settings_are_checked():
    g = fork_join(1.0)
    with pytest.raises(PlacerError, match="threshold"):
        place(g, cluster(2), placer="m-sct", threshold=2.0)
    with pytest.raises(PlacerError, match="max_lp_nodes"):
        place(g, cluster(2), placer="m-sct", max_lp_nodes=-1)


# ----------------------------------------------------------------------------- determinism and order


@pytest.mark.parametrize("name", LIST_PLACERS)
def test_deterministic_and_feasible_on_a_heterogeneous_cluster(name):
    g = layered_graph(300, width=6, seed=9)
    c = cluster(3, bw=5e9, lat=1e-5, speeds=[1.0, 2.0, 0.5], links={(0, 1): (2e10, 2e-6)})
    p1 = place(g, c, placer=name, seed=1)
    p2 = place(g, c, placer=name, seed=2)
    assert p1.assignment == p2.assignment  # the seed is unused
    assert simulate(g, c, p1).feasible
    # the fast device gets work
    assert np.bincount(list(p1.assignment.values()), minlength=3)[1] > 0


def test_the_order_reaches_m_etf_and_m_sct():
    g = layered_graph(200, width=16, seed=2)
    c = cluster(4, bw=1e9, lat=1e-5)
    for name in ("m-etf", "m-sct"):
        a = place(g, c, placer=name, order="topo").assignment
        b = place(g, c, placer=name, order="reversed-topo").assignment
        assert a != b


def random_graph(rng: np.random.Generator, n: int) -> CompGraph:
    """Zero-time ops, 0-byte edges and parallel edges (two tensors u -> v) included."""
    nodes = [{"id": f"n{v}", "compute_s": float(rng.choice([0.0, rng.uniform(0, 2)])),
              "output_bytes": float(rng.integers(0, 50))} for v in range(n)]
    edges, sizes = [], {}
    for v in range(1, n):
        for u in rng.choice(v, size=min(v, int(rng.integers(0, 4))), replace=False).tolist():
            for t in range(int(rng.integers(1, 3))):
                b = sizes.setdefault((u, t), float(rng.choice([0, rng.integers(1, 40)])))
                edges.append({"src": f"n{u}", "dst": f"n{v}", "bytes": b, "tensor": t})
    return CompGraph.build("r", nodes, edges)


def test_list_schedules_respect_precedence_transfers_and_one_op_per_device():
    # The core's own schedule is a valid schedule: ops on one device do not overlap, and each op starts
    # after every input is there (its producer's finish, plus the transfer when the devices differ).
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, nd = int(rng.integers(1, 30)), int(rng.integers(1, 5))
        g = random_graph(rng, n)
        c = Cluster("c", tuple(Device(f"g{i}", 1e9, float(rng.choice([0.5, 1.0, 2.0]))) for i in range(nd)),
                    Link(float(rng.uniform(5, 50)), float(rng.choice([0.0, 0.1]))),
                    {(0, nd - 1): Link(100.0, 0.0)} if nd > 1 else {})
        ls = ListScheduler(g, c)
        key = order_keys(rng.permutation(n))
        prio = heft_priority(g, c)
        for s in (ls.event(key), ls.event(key, favourite=favourite_children(g, c, 0.5)), ls.heft(prio, True),
                  ls.heft(prio, False)):
            assert s.complete
            dev, st, fi = s.devices, s.start_s, s.finish_s
            assert fi - st == pytest.approx(g.compute_s / c.speeds[dev])
            for d in range(nd):
                on = np.flatnonzero(dev == d)
                on = on[np.lexsort((fi[on], st[on]))]
                assert np.all(fi[on][:-1] <= st[on][1:] + 1e-12)
            u, v = g.edge_src, g.edge_dst
            cross = dev[u] != dev[v]
            arrive = fi[u] + np.where(cross, c.latency[dev[u], dev[v]] + g.edge_bytes / c.bandwidth[dev[u], dev[v]], 0)
            assert np.all(st[v] >= arrive - 1e-9)
