"""Hand cases and brute-force checks for the basic placers: single, round-robin, random, contiguous, m-topo."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cluster, graph
from devplace.graph import CompGraph
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.orders import traversal_indices
from devplace.placers import NoFitError, PlacerError, place
from devplace.placers.common import op_memory
from devplace.placers.contiguous import best_split, chunk_memory_bound, contiguous
from devplace.placers.m_topo import baechi_caps, fill_in_order, m_topo
from devplace.placers.random_placer import random_placement
from devplace.sim.devplace_model import DevplaceModel


def chain(n: int, *, compute: list[float] | None = None, params: list[float] | None = None,
          out: float = 0.0) -> CompGraph:
    compute = compute or [1.0] * n
    params = params or [0.0] * n
    nodes = [{"id": f"n{i}", "compute_s": compute[i], "param_bytes": params[i], "output_bytes": out}
             for i in range(n)]
    return graph(nodes, [(f"n{i}", f"n{i + 1}", out) for i in range(n - 1)])


def devices_of(graph_: CompGraph, placement) -> list[int]:
    return [placement.assignment[nid] for nid in graph_.ids]


def two_branches() -> CompGraph:
    """src -> a1 -> a2 -> a3 -> join and src -> b1 -> b2 -> b3 -> join: `topo` interleaves the branches,
    `dfs-preorder` walks branch a to the join before branch b, `reversed-topo` starts at the join."""
    ids = ["src", "a1", "a2", "a3", "b1", "b2", "b3", "join"]
    nodes = [{"id": i, "compute_s": 1.0, "param_bytes": 10.0, "output_bytes": 1.0} for i in ids]
    edges = [("src", "a1", 1), ("a1", "a2", 1), ("a2", "a3", 1), ("a3", "join", 1),
             ("src", "b1", 1), ("b1", "b2", 1), ("b2", "b3", 1), ("b3", "join", 1)]
    return graph(nodes, edges)


# --------------------------------------------------------------------------- round-robin


def test_round_robin_deals_the_order_out_in_turn():
    g = chain(5)
    assert devices_of(g, place(g, cluster(2), placer="round-robin")) == [0, 1, 0, 1, 0]
    # reversed-topo visits n4 first: n4 -> 0, n3 -> 1, n2 -> 2, n1 -> 0, n0 -> 1
    assert devices_of(g, place(g, cluster(3), placer="round-robin", order="reversed-topo")) == [1, 0, 2, 1, 0]


def test_round_robin_over_memory_is_an_error_not_a_repair():
    g = chain(4, params=[40.0, 10.0, 40.0, 10.0])  # round-robin puts 80 on device 0, 20 on device 1
    with pytest.raises(NoFitError, match="round-robin placement is over memory on device"):
        place(g, cluster(2, mem=60.0), placer="round-robin")


# --------------------------------------------------------------------------- single


def test_single_picks_the_fastest_device_that_fits():
    g = chain(3, params=[10.0, 10.0, 10.0])
    devs = (Device("slow", 100.0, 1.0), Device("fast-small", 20.0, 2.0), Device("fast", 100.0, 2.0),
            Device("fast-too", 100.0, 2.0))
    c = Cluster("mixed", devs, Link(1e9))
    assert set(devices_of(g, place(g, c, placer="single"))) == {2}  # fastest that fits, lowest index


def test_single_raises_when_no_device_holds_the_step():
    g = chain(3, params=[10.0, 10.0, 10.0])
    with pytest.raises(NoFitError, match="on one device"):
        place(g, cluster(3, mem=20.0), placer="single")  # 60 in all, 30 needed on one device


# --------------------------------------------------------------------------- random


def test_random_is_the_first_feasible_of_its_draws():
    g = chain(3, params=[10.0, 10.0, 10.0])
    devs = (Device("big", 100.0), Device("tiny", 5.0))  # only "everything on device 0" fits
    c = Cluster("lopsided", devs, Link(1e9))
    rng = np.random.Generator(np.random.PCG64(3))
    draws = [rng.integers(0, 2, 3, dtype=np.int64) for _ in range(40)]
    first = next(j for j, d in enumerate(draws) if not d.any())
    assert first > 0
    got = random_placement(g, c, order=g.topo_order, seed=3, tries=first + 1)
    assert got.tolist() == [0, 0, 0]
    with pytest.raises(NoFitError, match=f"none of {first} random placements fits"):
        random_placement(g, c, order=g.topo_order, seed=3, tries=first)
    with pytest.raises(PlacerError, match="'tries' must be an integer >= 1"):
        place(g, c, placer="random", tries=0)


def test_random_is_deterministic_per_seed_and_ignores_the_order():
    g = chain(30)
    c = cluster(4)
    a = place(g, c, placer="random", seed=1)
    assert a.assignment == place(g, c, placer="random", seed=1, order="reversed-topo").assignment
    assert a.assignment != place(g, c, placer="random", seed=2).assignment


# --------------------------------------------------------------------------- m-topo


def test_m_topo_fills_devices_in_order_up_to_baechi_caps():
    g = chain(6, params=[10.0] * 6)  # op memory 10 each: total 60
    assert baechi_caps(g, cluster(3)).tolist() == [30.0] * 3  # 60 / 3 + 10
    assert devices_of(g, place(g, cluster(3), placer="m-topo")) == [0, 0, 0, 1, 1, 1]
    assert baechi_caps(g, cluster(3, mem=25.0)).tolist() == [25.0] * 3  # never above the capacity
    assert devices_of(g, place(g, cluster(3, mem=25.0), placer="m-topo")) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(NoFitError, match="ops remain after the last device"):
        place(chain(7, params=[10.0] * 7), cluster(3, mem=25.0), placer="m-topo")  # 2 per device, 7 ops


def test_m_topo_lowers_the_cap_of_a_device_the_simulator_finds_over_memory():
    nodes = [{"id": "n0", "compute_s": 1.0, "output_bytes": 40}, {"id": "n1", "compute_s": 1.0},
             {"id": "n2", "compute_s": 1.0, "output_bytes": 10},
             {"id": "n3", "compute_s": 1.0, "param_bytes": 30},
             {"id": "n4", "compute_s": 1.0, "output_bytes": 10, "param_bytes": 30}]
    g = graph(nodes, [("n0", "n2", 40)])
    c = cluster(3, mem=70.0)
    order = g.topo_order  # n0 n1 n3 n4 n2
    first = fill_in_order(op_memory(g), order, baechi_caps(g, c))
    assert first.tolist() == [0, 0, 1, 0, 1]
    assert not DevplaceModel(g, c).run(first).feasible  # device 1 receives n0's 40 bytes: 80 > 70
    assert devices_of(g, place(g, c, placer="m-topo", order="topo")) == [0, 0, 2, 0, 1]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 4))
def test_m_topo_is_monotone_along_the_order_and_within_caps(seed, k):
    from devplace.zoo import layered_graph

    g = layered_graph(40, width=5, seed=seed)
    c = cluster(k, bw=12e9, mem=1e12)
    order = traversal_indices(g, "dfs-preorder")
    devices = m_topo(g, c, order=order, seed=0)
    assert np.all(np.diff(devices[order]) >= 0)
    used = np.bincount(devices, weights=op_memory(g), minlength=k)
    assert np.all(used <= baechi_caps(g, c))


# --------------------------------------------------------------------------- contiguous


def test_contiguous_balances_compute_over_device_speeds():
    g = chain(6)
    assert devices_of(g, place(g, cluster(3), placer="contiguous")) == [0, 0, 1, 1, 2, 2]
    # speeds 2, 1, 1: the best bottleneck is 2; device 0 takes the longest prefix within it
    fast_first = cluster(3, speeds=[2.0, 1.0, 1.0])
    assert devices_of(g, place(g, fast_first, placer="contiguous")) == [0, 0, 0, 0, 1, 1]
    assert devices_of(g, place(g, cluster(3), placer="contiguous", devices=2)) == [0, 0, 0, 1, 1, 1]
    assert devices_of(g, place(g, cluster(3), placer="contiguous", devices=1)) == [0] * 6
    with pytest.raises(PlacerError, match="'devices' must be an integer >= 1"):
        place(g, cluster(3), placer="contiguous", devices=0)


def test_contiguous_respects_memory():
    # one heavy op: it must sit alone; the best split is then n0..n1 | n2 | n3..n5
    g = chain(6, params=[10.0, 10.0, 95.0, 10.0, 10.0, 10.0])
    p = place(g, cluster(3, mem=100.0), placer="contiguous")
    assert devices_of(g, p) == [0, 0, 1, 2, 2, 2]
    with pytest.raises(NoFitError, match="no split of the order"):
        place(g, cluster(2, mem=100.0), placer="contiguous")


def random_case(data) -> tuple[CompGraph, Cluster, np.ndarray]:
    """A small random DAG (a chain half the time), a random visiting order, a random heterogeneous cluster."""
    n = data.draw(st.integers(1, 7), label="n")
    is_chain = data.draw(st.booleans(), label="chain")
    nodes = [{"id": f"n{i}", "compute_s": data.draw(st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0])),
              "param_bytes": data.draw(st.sampled_from([0, 10, 20, 40])),
              "output_bytes": data.draw(st.sampled_from([0, 5, 10])),
              "temp_bytes": data.draw(st.sampled_from([0, 0, 7]))} for i in range(n)]
    edges = []
    for v in range(1, n):
        srcs = [v - 1] if is_chain else [u for u in range(v) if data.draw(st.booleans())]
        for u in srcs:
            edges.append({"src": f"n{u}", "dst": f"n{v}", "bytes": nodes[u]["output_bytes"]})
    g = graph(nodes, edges)
    k = data.draw(st.integers(1, 3), label="k")
    devs = tuple(Device(f"d{i}", float(data.draw(st.sampled_from([30, 50, 80, 200]))),
                        float(data.draw(st.sampled_from([1.0, 2.0])))) for i in range(k))
    c = Cluster("c", devs, Link(10.0, 0.1))
    order = np.array(data.draw(st.permutations(range(n)), label="order"), dtype=np.int64)
    return g, c, order


def all_splits(n: int, k: int):
    """Every split of n positions into k consecutive (possibly empty) chunks, as chunk ends."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        yield [*cuts, n]


def chunks(order: np.ndarray, ends: list[int]) -> list[np.ndarray]:
    return [order[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]


def bottleneck(g: CompGraph, c: Cluster, order: np.ndarray, ends: list[int]) -> float:
    return max(float(g.compute_s[s].sum()) / c.devices[i].speed for i, s in enumerate(chunks(order, ends)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_contiguous_equals_brute_force_over_all_cuts(data):
    g, c, order = random_case(data)
    k = c.num_devices
    model = DevplaceModel(g, c)
    best_u = best_sim = None  # brute force: under the guaranteed bound U, and under the simulator itself
    for ends in all_splits(g.num_nodes, k):
        b = bottleneck(g, c, order, ends)
        parts = chunks(order, ends)
        if all(chunk_memory_bound(g, s) <= c.devices[i].memory_bytes for i, s in enumerate(parts)):
            best_u = b if best_u is None else min(best_u, b)
        devices = np.empty(g.num_nodes, dtype=np.int64)
        for i, s in enumerate(parts):
            devices[s] = i
        if model.run(devices).feasible:
            best_sim = b if best_sim is None else min(best_sim, b)
    # the exact search under U alone
    found = best_split(g, c, order)
    if best_u is None:
        assert found is None
    else:
        assert found is not None
        assert found[1] == pytest.approx(best_u, rel=1e-12, abs=0)
        assert bottleneck(g, c, order, found[0]) == pytest.approx(best_u, rel=1e-12)
    # the placer: simulator-feasible, never worse than the optimum under U, never better than the true one
    try:
        devices = contiguous(g, c, order=order, seed=0)
    except NoFitError:
        assert best_u is None
        return
    assert model.run(devices).feasible
    assert np.all(np.diff(devices[order]) >= 0)  # consecutive chunks in device order
    ends = [int(np.searchsorted(devices[order], i, side="right")) for i in range(k)]
    got = bottleneck(g, c, order, ends)
    assert best_sim is not None and got >= best_sim - 1e-12
    if best_u is not None:
        assert got <= best_u + 1e-12


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_chunk_memory_bound_is_never_below_the_simulated_peak(data):
    g, c, _ = random_case(data)
    devices = np.array(data.draw(st.lists(st.integers(0, c.num_devices - 1), min_size=g.num_nodes,
                                          max_size=g.num_nodes)), dtype=np.int64)
    peak = DevplaceModel(g, c).run(devices).peak_memory_bytes
    for d in range(c.num_devices):
        assert chunk_memory_bound(g, np.flatnonzero(devices == d)) >= peak[d]


# --------------------------------------------------------------------------- the order reaches the placers


@pytest.mark.parametrize("placer", ["round-robin", "contiguous", "m-topo"])
def test_the_order_changes_the_placement(placer):
    g = two_branches()
    c = cluster(2, bw=1e9, mem=1e6)
    got = {order: tuple(devices_of(g, place(g, c, placer=placer, order=order)))
           for order in ("topo", "reversed-topo", "dfs-preorder")}
    assert len(set(got.values())) == 3, got
    # ids: src a1 a2 a3 b1 b2 b3 join
    if placer == "contiguous":  # half the compute on each device
        assert got["topo"] == (0, 0, 0, 1, 0, 1, 1, 1)  # src a1 b1 a2 | b2 a3 b3 join
        assert got["dfs-preorder"] == (0, 0, 0, 0, 1, 1, 1, 1)  # src a1 a2 a3 | join b1 b2 b3
    if placer == "m-topo":  # cap 8 * 11 / 2 + 11 = 55 bytes: five ops on device 0
        assert got["topo"] == (0, 0, 0, 1, 0, 0, 1, 1)  # src a1 b1 a2 b2 | a3 b3 join
        assert got["dfs-preorder"] == (0, 0, 0, 0, 1, 1, 1, 0)  # src a1 a2 a3 join | b1 b2 b3


@pytest.mark.parametrize("placer", ["single", "round-robin", "random", "contiguous", "m-topo"])
def test_same_seed_same_placement(placer):
    from devplace.zoo import layered_graph

    g = layered_graph(60, width=6, seed=1)
    c = cluster(3, bw=12e9, mem=1e12)
    assert place(g, c, placer=placer, seed=5).assignment == place(g, c, placer=placer, seed=5).assignment
