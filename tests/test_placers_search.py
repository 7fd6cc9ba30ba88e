"""The search placers on the simulator: `greedy` (sequential, order-driven) and `anneal` (local search)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cluster, graph
from devplace.graph import CompGraph
from devplace.orders import traversal_indices
from devplace.placers import NoFitError, PlacerError, PlacerSpec, place
from devplace.placers import anneal as anneal_module
from devplace.placers.anneal import anneal
from devplace.placers.greedy import greedy
from devplace.sim import DevplaceModel, simulate
from devplace.zoo import layered_graph


def run_greedy(g: CompGraph, c, order: str = "topo") -> np.ndarray:
    return greedy(g, c, order=traversal_indices(g, order), seed=0)


def step(g: CompGraph, c, devices) -> float:
    return simulate(g, c, np.asarray(devices)).step_time_s


def fixed_start(monkeypatch, devices) -> None:
    """Make anneal's `start` placer return `devices` (a start that no registered placer would give)."""
    def start(graph, cluster, *, order, seed):
        """A fixed start placement."""
        return np.array(devices, dtype=np.int64)
    monkeypatch.setattr(anneal_module, "get_placer", lambda name: PlacerSpec(name, start, False))


def tight_graph() -> CompGraph:
    """A chain of 6 ops of 100 bytes of parameters each and tiny activations: at most 3 fit a device of 350."""
    nodes = [{"id": f"c{i}", "compute_s": 1.0 + 0.1 * i, "param_bytes": 100.0, "output_bytes": 1.0}
             for i in range(6)]
    edges = [(f"c{i}", f"c{i + 1}", 1.0) for i in range(5)]
    return graph(nodes, edges)


# --------------------------------------------------------------------------- greedy


def test_greedy_splits_two_independent_heavy_chains():
    g = graph([("a1", 1.0), ("a2", 1.0), ("a3", 1.0), ("b1", 1.0), ("b2", 1.0), ("b3", 1.0)],
              [("a1", "a2", 1.0), ("a2", "a3", 1.0), ("b1", "b2", 1.0), ("b2", "b3", 1.0)])
    c = cluster(2, bw=10.0)
    dev = run_greedy(g, c)
    # topo visits a1 b1 a2 b2 a3 b3: b1 goes next to the idle device, each chain then stays put
    assert dev.tolist() == [0, 0, 0, 1, 1, 1]
    assert step(g, c, dev) == pytest.approx(3.0)


def test_greedy_keeps_a_chain_with_expensive_communication_on_one_device():
    g = graph([(f"c{i}", 1.0) for i in range(5)], [(f"c{i}", f"c{i + 1}", 100.0) for i in range(4)])
    dev = run_greedy(g, cluster(3, bw=1.0))
    assert dev.tolist() == [0] * 5


def test_greedy_prefers_the_faster_device():
    g = graph([("x", 1.0)], [])
    assert run_greedy(g, cluster(3, speeds=[1.0, 2.0, 2.0])).tolist() == [1]  # tie between 1 and 2: lowest


def test_greedy_gives_different_placements_for_different_orders():
    # n0 -> n3 carries 5 bytes (0.5 s at 10 B/s); n1 and n2 are independent. What greedy knows when it
    # places each op depends on the walk:
    # - topo (n0 n1 n2 n3): n1 balances against n0, n2 joins n0, and n3 then prefers n1's device (5 s < 6 s);
    # - dfs-preorder (n0 n3 n1 n2): n3 joins its input n0 before n1 and n2 exist; n2 balances to device 1;
    # - reversed-topo (n3 n2 n1 n0): n3 first on device 0, n2 balances to 1, n1 ties (5 s both) -> 0, and
    #   n0 goes to device 1 so that n1 and n3 keep device 0 busy.
    g = graph([("n0", 2.0), ("n1", 3.0), ("n2", 2.0), ("n3", 2.0)], [("n0", "n3", 5.0)])
    c = cluster(2, bw=10.0)
    got = {o: run_greedy(g, c, o).tolist() for o in ("topo", "dfs-preorder", "reversed-topo")}
    assert got == {"topo": [0, 1, 0, 1], "dfs-preorder": [0, 1, 1, 0], "reversed-topo": [1, 0, 1, 0]}


def test_greedy_order_changes_placements_on_a_layered_graph():
    g = layered_graph(48, width=6, seed=1)
    c = cluster(3, bw=12e9, lat=1e-5)
    placements = {o: tuple(run_greedy(g, c, o).tolist()) for o in ("topo", "reversed-topo", "dfs-preorder", "bfs")}
    assert len(set(placements.values())) == len(placements)


def test_greedy_each_choice_is_the_best_feasible_device_for_the_partial_placement():
    """Replays greedy's rule on its own result: op k of the order sits on the device that minimises the step
    time of the subgraph induced by the first k ops (memory-feasible; ties -> lowest index)."""
    g = layered_graph(30, width=4, seed=2)
    need = float(g.param_bytes.sum() + g.output_bytes.sum())
    c = cluster(3, bw=12e9, lat=1e-5, mem=0.45 * need)  # tight enough that some devices are ruled out
    order = traversal_indices(g, "bfs")
    dev = greedy(g, c, order=order, seed=0)
    model = DevplaceModel(g, c)
    active = np.zeros(g.num_nodes, dtype=bool)
    ruled_out = 0
    for v in order.tolist():
        active[v] = True
        trial = dev.copy()
        times = []
        for d in range(c.num_devices):
            trial[v] = d
            r = model.run(trial, active)
            times.append(r.step_time_s if r.feasible else np.inf)
        ruled_out += int(np.isinf(times).sum())
        assert dev[v] == int(np.argmin(times)) and np.isfinite(times[dev[v]])
    assert ruled_out > 0
    assert simulate(g, c, dev).feasible


def test_greedy_never_worse_than_the_best_single_device_on_hand_graphs():
    g = layered_graph(40, width=4, seed=4)
    c = cluster(2, bw=12e9, lat=1e-5)
    single = min(step(g, c, np.full(g.num_nodes, d)) for d in range(2))
    assert step(g, c, run_greedy(g, c)) <= single


def test_greedy_respects_memory():
    g = tight_graph()
    c = cluster(2, bw=10.0, mem=350.0)
    dev = run_greedy(g, c)
    assert simulate(g, c, dev).feasible
    assert np.bincount(dev).tolist() == [3, 3]


def test_greedy_raises_when_an_op_fits_no_device():
    g = graph([{"id": "big", "compute_s": 1.0, "param_bytes": 500.0}, {"id": "small", "compute_s": 1.0}], [])
    with pytest.raises(NoFitError, match=r"op 'big' fits on no device.*needs about"):
        place(g, cluster(2, mem=400.0), placer="greedy")


def test_greedy_through_place_records_the_order():
    g = layered_graph(24, width=4, seed=3)
    p = place(g, cluster(2, bw=12e9), placer="greedy", order="dfs-postorder")
    assert p.made_by.order == "dfs-postorder"
    assert p.meta["step_time_s"] == step(g, cluster(2, bw=12e9), p.to_array(g, 2))


# --------------------------------------------------------------------------- anneal


def test_anneal_never_worse_than_its_start(monkeypatch):
    g = layered_graph(40, width=5, seed=6)
    c = cluster(3, bw=12e9, lat=1e-5)
    order = traversal_indices(g, "topo")
    greedy_dev = greedy(g, c, order=order, seed=0)
    for start in (np.zeros(g.num_nodes, dtype=np.int64), greedy_dev):
        fixed_start(monkeypatch, start)
        for seed in range(3):
            dev = anneal(g, c, order=order, seed=seed, steps=300)
            assert step(g, c, dev) <= step(g, c, start)
    # from a poor start it finds better placements
    fixed_start(monkeypatch, np.zeros(g.num_nodes, dtype=np.int64))
    assert step(g, c, anneal(g, c, order=order, steps=300)) < step(g, c, np.zeros(g.num_nodes, dtype=np.int64))


def test_anneal_from_a_named_placer_is_never_worse_than_that_placer():
    g = layered_graph(40, width=5, seed=7)
    c = cluster(2, bw=12e9, lat=1e-5)
    # one order for both: with order="auto" greedy (cheap) is tried under every order, anneal (not cheap) is not
    p = place(g, c, placer="anneal", order="topo", start="greedy", steps=200, initial_temp=0.05)
    assert p.meta["step_time_s"] <= place(g, c, placer="greedy", order="topo").meta["step_time_s"]


def test_anneal_is_deterministic_for_a_seed(monkeypatch):
    g = layered_graph(40, width=5, seed=8)
    c = cluster(3, bw=12e9, lat=1e-5)
    order = traversal_indices(g, "bfs")
    fixed_start(monkeypatch, np.zeros(g.num_nodes, dtype=np.int64))
    runs = [anneal(g, c, order=order, seed=s, steps=250).tolist() for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_anneal_order_changes_the_search(monkeypatch):
    g = layered_graph(40, width=5, seed=8)
    c = cluster(3, bw=12e9, lat=1e-5)
    fixed_start(monkeypatch, np.zeros(g.num_nodes, dtype=np.int64))
    a = anneal(g, c, order=traversal_indices(g, "topo"), seed=1, steps=100)
    b = anneal(g, c, order=traversal_indices(g, "reversed-topo"), seed=1, steps=100)
    assert a.tolist() != b.tolist()


def test_anneal_never_returns_an_over_memory_placement(monkeypatch):
    g = tight_graph()
    c = cluster(2, bw=10.0, mem=350.0)
    order = traversal_indices(g, "topo")
    feasible_start = [0, 0, 0, 1, 1, 1]
    fixed_start(monkeypatch, feasible_start)
    for seed in range(4):
        # a hot search proposes many over-memory moves; none may come back
        dev = anneal(g, c, order=order, seed=seed, steps=200, initial_temp=10.0, final_temp=1.0)
        r = simulate(g, c, dev)
        assert r.feasible
        assert r.step_time_s <= step(g, c, feasible_start)
    # from an over-memory start the search repairs it, or says that nothing fits
    fixed_start(monkeypatch, [0] * 6)
    dev = anneal(g, c, order=order, seed=0, steps=200)
    assert simulate(g, c, dev).feasible


def test_anneal_raises_when_it_never_sees_a_feasible_placement(monkeypatch):
    g = tight_graph()
    c = cluster(2, bw=10.0, mem=250.0)  # 600 bytes of parameters, 500 of memory
    fixed_start(monkeypatch, [0] * 6)
    with pytest.raises(NoFitError, match=r"anneal.*needs about"):
        anneal(g, c, order=traversal_indices(g, "topo"), seed=0, steps=50)


def test_anneal_time_limit_stops_the_search(monkeypatch):
    g = layered_graph(40, width=5, seed=9)
    c = cluster(2, bw=12e9)
    fixed_start(monkeypatch, np.zeros(g.num_nodes, dtype=np.int64))
    dev = anneal(g, c, order=traversal_indices(g, "topo"), steps=10**6, time_limit_s=0.2)
    assert simulate(g, c, dev).feasible


@pytest.mark.parametrize("bad", [{"start": "anneal"}, {"steps": -1}, {"time_limit_s": 0},
                                 {"initial_temp": 0.001, "final_temp": 0.01}, {"swap_prob": 1.5}])
def test_anneal_rejects_bad_settings(bad):
    g = layered_graph(12, width=3, seed=0)
    with pytest.raises(PlacerError):
        place(g, cluster(2), placer="anneal", **bad)
