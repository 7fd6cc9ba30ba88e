"""`ilp` against brute force, and `partition` on graphs whose right answer is known."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conftest import cluster, graph
from devplace.errors import DevplaceError
from devplace.graph import CompGraph
from devplace.placers import NoFitError, get_placer, place
from devplace.placers.ilp import IlpTooLargeError, solve_ilp
from devplace.placers.partition import metis_parts, quotient_is_acyclic, undirected_graph
from devplace.sim import DevplaceModel, lower_bound
from devplace.zoo import layered_graph

GB = 1e9


def brute_force(g: CompGraph, c) -> tuple[float, np.ndarray]:
    """The shortest simulated step time over all D^V placements that fit, and one placement reaching it."""
    model = DevplaceModel(g, c)
    best_t, best = np.inf, None
    for devs in itertools.product(range(c.num_devices), repeat=g.num_nodes):
        r = model.run(np.array(devs, dtype=np.int64))
        if r.feasible and r.step_time_s < best_t:
            best_t, best = r.step_time_s, np.array(devs)
    assert best is not None
    return best_t, best


def chain(n: int, seed: int, *, params: bool = False, out: bool = False, two_tensors: bool = False) -> CompGraph:
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(n):
        rec = {"id": f"n{i}", "compute_s": float(rng.uniform(1e-4, 1e-3))}
        if params:
            rec["param_bytes"] = float(rng.integers(1, 10)) * GB
        if out:
            rec["output_bytes"] = float(rng.integers(1, 4)) * GB
        nodes.append(rec)
    edges = [(f"n{i}", f"n{i + 1}", float(rng.uniform(1e6, 1e7))) for i in range(n - 1)]
    if two_tensors:  # a second tensor on one edge: both queue on one channel, back to back
        edges.append(("n1", "n2", 3e6, 1))
    return graph(nodes, edges, name=f"chain{n}-{seed}")


def out_star(leaves: int, seed: int) -> CompGraph:
    rng = np.random.default_rng(seed)
    nodes = [("root", float(rng.uniform(1e-4, 1e-3)))]
    nodes += [(f"l{i}", float(rng.uniform(1e-4, 1e-3))) for i in range(leaves)]
    return graph(nodes, [("root", f"l{i}", 4e6) for i in range(leaves)], name=f"star{leaves}-{seed}")


# --------------------------------------------------------------------------- ilp


# graphs where no channel ever carries two transfers at once and the simulator's order is optimal, so the
# program's model and the simulator agree on every placement
EXACT_CASES = [
    pytest.param(chain(6, 0), cluster(2, bw=1e10, lat=5e-5), id="chain6-2dev"),
    pytest.param(chain(7, 1), cluster(3, bw=2e10, lat=1e-5, speeds=[1.0, 2.0, 0.5]), id="chain7-3dev-speeds"),
    pytest.param(chain(6, 2, two_tensors=True), cluster(3, bw=1e10, lat=1e-5, speeds=[1.0, 1.5, 1.5]),
                 id="chain6-two-tensors"),
    pytest.param(chain(6, 3, params=True), cluster(3, bw=1e10, lat=1e-5, mem=16 * GB), id="chain6-memory"),
    pytest.param(chain(6, 4), cluster(3, bw=2e9, lat=1e-5, links={(0, 2): (5e10, 1e-6), (2, 0): (5e10, 1e-6)}),
                 id="chain6-links"),
    pytest.param(out_star(5, 5), cluster(3, bw=2e10, lat=1e-5), id="star6-3dev"),
    pytest.param(out_star(6, 6), cluster(2, bw=1e10, lat=1e-5, speeds=[1.0, 3.0]), id="star7-2dev-speeds"),
]


@pytest.mark.parametrize(("g", "c"), EXACT_CASES)
def test_ilp_equals_brute_force_where_the_models_agree(g, c):
    best_t, _ = brute_force(g, c)
    r = solve_ilp(g, c)
    assert r.optimal
    assert r.step_time_s == pytest.approx(best_t, rel=1e-6)
    assert r.objective_s == pytest.approx(best_t, rel=1e-6)  # no contention: the program's makespan is the sim's
    p = place(g, c, placer="ilp")
    assert p.meta["step_time_s"] == pytest.approx(best_t, rel=1e-6)


def test_ilp_rejects_placements_the_simulator_finds_over_memory():
    # outputs of 1-3 GB: the live memory (received tensors) is not in the program's rows, so the program's
    # first choices can be over memory in the simulator; they are cut off until one fits
    g = chain(6, 4, params=True, out=True)
    c = cluster(3, bw=1e10, lat=1e-5, mem=14 * GB)
    best_t, _ = brute_force(g, c)
    r = solve_ilp(g, c)
    assert r.rounds > 1
    assert DevplaceModel(g, c).run(r.devices).feasible
    assert r.step_time_s == pytest.approx(best_t, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ilp_objective_bounds_every_placement_from_below(seed):
    # general small DAGs: channels can be contended, so the program is a relaxation of the simulator
    g = layered_graph(7, width=3, fan_in=2, seed=seed)
    c = cluster(3, bw=12e9, lat=1e-5)
    best_t, _ = brute_force(g, c)
    r = solve_ilp(g, c)
    assert r.optimal
    assert r.bound_s <= r.objective_s * (1 + 1e-6)
    assert r.objective_s <= best_t * (1 + 1e-6)
    assert best_t <= r.step_time_s * (1 + 1e-12)
    assert r.objective_s >= lower_bound(g, c).value_s * (1 - 1e-6)


def test_ilp_above_max_nodes_says_what_to_do():
    g = layered_graph(31, width=4, seed=0)
    c = cluster(2, bw=12e9)
    with pytest.raises(IlpTooLargeError, match=r"at most max_nodes=30 ops .* has 31.*Coarsen") as info:
        place(g, c, placer="ilp")
    assert isinstance(info.value, DevplaceError)
    with pytest.raises(IlpTooLargeError, match="max_nodes=8"):
        place(layered_graph(9, width=3), c, placer="ilp", max_nodes=8)


def test_ilp_raises_no_fit_when_no_device_holds_an_op():
    # the parameters fit in total, but one op alone is larger than any device
    g = graph([{"id": "a", "compute_s": 1e-3, "param_bytes": 12 * GB}, {"id": "b", "compute_s": 1e-3}],
              [("a", "b", 1e6)])
    with pytest.raises(NoFitError, match="needs about"):
        place(g, cluster(2, bw=1e10, mem=10 * GB), placer="ilp")


def test_ilp_stopped_by_its_time_limit_still_returns_a_placement_that_fits():
    g = layered_graph(24, width=4, fan_in=2, seed=1)
    c = cluster(3, bw=12e9, lat=1e-5)
    r = solve_ilp(g, c, time_limit_s=0.05)
    assert not r.optimal
    assert DevplaceModel(g, c).run(r.devices).feasible
    with pytest.raises(DevplaceError, match="time_limit_s"):
        place(g, c, placer="ilp", time_limit_s=0)


def test_ilp_does_not_use_the_order():
    assert not get_placer("ilp").uses_order
    g, c = chain(5, 8), cluster(2, bw=1e10, lat=1e-5)
    a = place(g, c, placer="ilp", order="topo").assignment
    assert place(g, c, placer="ilp", order="reversed-topo").assignment == a


# --------------------------------------------------------------------------- partition


def clique(prefix: str, k: int, compute: float, nbytes: float) -> tuple[list, list]:
    nodes = [(f"{prefix}{i}", compute) for i in range(k)]
    edges = [(f"{prefix}{i}", f"{prefix}{j}", nbytes) for i in range(k) for j in range(i + 1, k)]
    return nodes, edges


def test_partition_splits_two_heavy_components_onto_two_devices():
    na, ea = clique("a", 6, 1e-3, 1e8)
    nb, eb = clique("b", 6, 1e-3, 1e8)
    g = graph(na + nb, ea + eb)
    p = place(g, cluster(2, bw=1e10, lat=1e-5), placer="partition")
    on_a = {p.assignment[f"a{i}"] for i in range(6)}
    on_b = {p.assignment[f"b{i}"] for i in range(6)}
    assert len(on_a) == 1 and len(on_b) == 1 and on_a != on_b


@pytest.mark.parametrize("speeds", [[1.0, 1.0, 1.0], [1.0, 2.0, 1.0]])
def test_partition_balances_compute_time_by_device_speed(speeds):
    g = layered_graph(300, width=10, seed=4)
    c = cluster(3, bw=12e9, lat=1e-5, speeds=speeds)
    p = place(g, c, placer="partition", seed=1)
    busy = DevplaceModel(g, c).run(p.to_array(g, 3)).device_busy_s
    assert busy.max() <= 1.15 * busy.mean()
    # and it cuts far fewer edges than dealing the ops out in turn
    d = p.to_array(g, 3)
    assert (d[g.edge_src] != d[g.edge_dst]).sum() < 0.5 * g.num_edges


def test_partition_repairs_memory_when_the_balanced_cut_does_not_fit():
    # a chain: METIS cuts it in the middle, putting all of the first five ops' 50 GB of parameters on one device
    nodes = [{"id": f"n{i}", "compute_s": 1e-3, "param_bytes": 10 * GB if i < 5 else 0.0} for i in range(20)]
    g = graph(nodes, [(f"n{i}", f"n{i + 1}", 1e7) for i in range(19)])
    c = cluster(2, bw=1e10, lat=1e-5, mem=31 * GB)
    model = DevplaceModel(g, c)
    raw = metis_parts(g, c, undirected_graph(g, c), seed=0, imbalance=0.03)
    assert not model.run(raw).feasible  # the test is tight: the plain min-cut does not fit
    for acyclic in (False, True):
        p = place(g, c, placer="partition", acyclic=acyclic)
        devices = p.to_array(g, 2)
        assert model.run(devices).feasible
        if acyclic:
            assert quotient_is_acyclic(g, devices, 2)
    with pytest.raises(NoFitError, match="needs about"):
        place(g, cluster(2, bw=1e10, mem=26 * GB), placer="partition")  # 50 GB fits in total, no split does


def test_partition_acyclic_option_gives_an_acyclic_quotient_graph():
    g = layered_graph(240, width=8, fan_in=2, seed=5)
    c = cluster(3, bw=12e9, lat=1e-5)
    raw = place(g, c, placer="partition").to_array(g, 3)
    assert not quotient_is_acyclic(g, raw, 3)  # METIS's own split ping-pongs between devices here
    p = place(g, c, placer="partition", acyclic=True)
    d = p.to_array(g, 3)
    assert quotient_is_acyclic(g, d, 3)
    assert len(set(d.tolist())) == 3  # still uses every device
    busy = DevplaceModel(g, c).run(d).device_busy_s
    assert busy.max() <= 1.2 * busy.mean()


def test_partition_is_deterministic_and_ignores_the_order():
    assert not get_placer("partition").uses_order
    g = layered_graph(200, width=8, seed=2)
    c = cluster(4, bw=12e9, lat=1e-5)
    a = place(g, c, placer="partition", seed=3).assignment
    assert place(g, c, placer="partition", seed=3).assignment == a
    assert place(g, c, placer="partition", seed=3, order="bfs").assignment == a
    b = place(g, c, placer="partition", seed=3, acyclic=True).assignment
    assert place(g, c, placer="partition", seed=3, acyclic=True, order="dfs-preorder").assignment == b


def test_partition_rejects_a_bad_imbalance():
    with pytest.raises(DevplaceError, match="imbalance"):
        place(chain(4, 0), cluster(2), placer="partition", imbalance=0)


def test_partition_handles_fewer_ops_than_devices_and_one_device():
    g = graph([("a", 1e-3), ("b", 2e-3)], [("a", "b", 1e6)])
    p = place(g, cluster(4, bw=1e10, speeds=[1.0, 1.0, 3.0, 2.0]), placer="partition")
    assert p.assignment == {"a": 3, "b": 2}  # heaviest op on the fastest device
    assert set(place(g, cluster(1), placer="partition").assignment.values()) == {0}
