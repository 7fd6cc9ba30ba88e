"""Graph features (devplace.graph.features): hand-computed values on small graphs, properties on random DAGs."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devplace.errors import DevplaceError
from devplace.graph import CompGraph
from devplace.graph.features import FEATURE_DESCRIPTIONS, FEATURE_NAMES, graph_features_on_link
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.sim.bounds import lower_bound

SHARES = ("branching_share", "merging_share", "skip_edge_share", "top10_compute_share", "forward_compute_share",
          "backward_compute_share", "optimizer_compute_share")


def build(nodes: list, edges: list) -> CompGraph:
    """Nodes as dicts or (id, compute_s); edges as dicts or (src, dst, bytes[, tensor])."""
    recs = [n if isinstance(n, dict) else {"id": n[0], "compute_s": n[1]} for n in nodes]
    erecs = [e if isinstance(e, dict) else
             {"src": e[0], "dst": e[1], "bytes": e[2], **({"tensor": e[3]} if len(e) > 3 else {})} for e in edges]
    return CompGraph.build("t", recs, erecs)


def check(got: dict[str, float], expected: dict[str, float]) -> None:
    for key, want in expected.items():
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(want, rel=1e-12, abs=1e-15), key


# ----------------------------------------------------------------------------- hand graphs


def test_chain() -> None:
    """a -> b -> c -> d, compute 1 2 3 4, 10 bytes per edge, no output_bytes, no kinds."""
    g = build([("a", 1), ("b", 2), ("c", 3), ("d", 4)], [("a", "b", 10), ("b", "c", 10), ("c", "d", 10)])
    f = graph_features_on_link(g, bandwidth_Bps=10, latency_s=0.5, speed=2)
    check(f, {
        "nodes": 4, "edges": 3, "distinct_edges": 3, "sources": 1, "sinks": 1, "depth": 3, "width": 1,
        "mean_width": 1, "mean_degree": 0.75, "max_in_degree": 1, "max_out_degree": 1, "branching_share": 0,
        "merging_share": 0, "skip_edges": 0, "skip_edge_share": 0, "mean_edge_span": 1, "total_compute_s": 10,
        "critical_path_s": 10, "parallelism": 1, "top10_compute_share": 0.4,
        "compute_cv": math.sqrt(1.25) / 2.5,  # mean 2.5, squared deviations 2.25 0.25 0.25 2.25
        "forward_compute_share": 0, "backward_compute_share": 0, "optimizer_compute_share": 0,
        "edge_bytes_per_output_byte": math.nan,  # no output_bytes
        "comm_to_compute": (3 * 0.5 + 30 / 10) / (10 / 2),  # 0.9
    })
    assert f["parallelism"] == 1.0  # exactly


def test_diamond_with_kinds_and_bytes() -> None:
    """a -> b, a -> c, b -> d, c -> d; compute 1 2 3 1; kinds forward forward backward optimizer."""
    nodes = [{"id": "a", "compute_s": 1, "kind": "forward", "output_bytes": 100},
             {"id": "b", "compute_s": 2, "kind": "forward", "output_bytes": 50},
             {"id": "c", "compute_s": 3, "kind": "backward", "output_bytes": 50},
             {"id": "d", "compute_s": 1, "kind": "optimizer"}]
    g = build(nodes, [("a", "b", 100), ("a", "c", 100), ("b", "d", 50), ("c", "d", 50)])
    f = graph_features_on_link(g, bandwidth_Bps=100)
    check(f, {
        "nodes": 4, "edges": 4, "distinct_edges": 4, "sources": 1, "sinks": 1, "depth": 2, "width": 2,
        "mean_width": 4 / 3, "mean_degree": 1, "max_in_degree": 2, "max_out_degree": 2, "branching_share": 0.25,
        "merging_share": 0.25, "skip_edges": 0, "skip_edge_share": 0, "mean_edge_span": 1, "total_compute_s": 7,
        "critical_path_s": 5, "parallelism": 7 / 5, "top10_compute_share": 3 / 7,
        "forward_compute_share": 3 / 7, "backward_compute_share": 3 / 7, "optimizer_compute_share": 1 / 7,
        "edge_bytes_per_output_byte": 300 / 200, "comm_to_compute": (300 / 100) / 7,
    })


def test_fork_join_with_skip_edges() -> None:
    """s -> a -> b -> t, s -> c -> t, s -> t. Levels s0 a1 b2 c1 t3: c -> t spans 2 and s -> t spans 3."""
    g = build([("s", 1), ("a", 1), ("b", 1), ("c", 4), ("t", 1)],
              [("s", "a", 1), ("a", "b", 1), ("b", "t", 1), ("s", "c", 1), ("c", "t", 1), ("s", "t", 1)])
    f = graph_features_on_link(g)
    check(f, {
        "nodes": 5, "edges": 6, "distinct_edges": 6, "sources": 1, "sinks": 1, "depth": 3, "width": 2,
        "mean_width": 5 / 4, "mean_degree": 6 / 5, "max_in_degree": 3, "max_out_degree": 3,
        "branching_share": 1 / 5, "merging_share": 1 / 5, "skip_edges": 2, "skip_edge_share": 2 / 6,
        "mean_edge_span": (1 + 1 + 1 + 1 + 2 + 3) / 6, "total_compute_s": 8,
        "critical_path_s": 6,  # s -> c -> t
        "parallelism": 8 / 6, "top10_compute_share": 4 / 8,
        "comm_to_compute": math.nan,  # no bandwidth given
    })


def test_parallel_edges_count_once() -> None:
    """u -> v twice (tensors 0 and 1), v -> w, and a 0-byte control edge u -> w (a skip edge)."""
    g = build([("u", 1), ("v", 1), ("w", 1)],
              [("u", "v", 10, 0), ("u", "v", 20, 1), ("v", "w", 5), ("u", "w", 0, 2)])
    f = graph_features_on_link(g, bandwidth_Bps=10, latency_s=1)
    check(f, {
        "nodes": 3, "edges": 4, "distinct_edges": 3, "mean_degree": 1, "sources": 1, "sinks": 1,
        "max_in_degree": 2,  # w: v and u; v has two in-edges but one predecessor
        "max_out_degree": 2, "branching_share": 1 / 3, "merging_share": 1 / 3,  # only w merges
        "depth": 2, "width": 1, "skip_edges": 1, "skip_edge_share": 1 / 3, "mean_edge_span": 4 / 3,
        "parallelism": 1,
        # every edge record is a transfer, the control edge too: 4 latencies + 35 bytes / 10 B/s
        "comm_to_compute": (4 * 1 + 35 / 10) / 3,
    })


def test_zero_compute_uses_unit_weights() -> None:
    g = build([("a", 0), ("b", 0), ("c", 0), ("d", 0)], [("a", "b", 1), ("a", "c", 1), ("b", "d", 1), ("c", "d", 1)])
    f = graph_features_on_link(g, bandwidth_Bps=1)
    check(f, {"total_compute_s": 0, "critical_path_s": 0, "parallelism": 4 / 3, "top10_compute_share": 1 / 4,
              "compute_cv": 0, "comm_to_compute": math.nan})
    assert f["parallelism"] == f["mean_width"]


def test_independent_ops_and_empty_graph() -> None:
    f = graph_features_on_link(build([(f"n{i}", i + 1) for i in range(20)], []))
    check(f, {"depth": 0, "width": 20, "sources": 20, "sinks": 20, "mean_degree": 0, "skip_edge_share": 0,
              "mean_edge_span": 0, "parallelism": 210 / 20, "top10_compute_share": (20 + 19) / 210})
    empty = graph_features_on_link(CompGraph.build("e", [], []))
    assert list(empty) == list(FEATURE_NAMES)
    assert empty["nodes"] == 0 and empty["parallelism"] == 1.0 and math.isnan(empty["comm_to_compute"])


def test_comm_to_compute_scales() -> None:
    g = build([("a", 2), ("b", 2)], [("a", "b", 100)])
    base = graph_features_on_link(g, bandwidth_Bps=100)["comm_to_compute"]
    assert base == pytest.approx(1 / 4)
    assert graph_features_on_link(g, bandwidth_Bps=100, speed=2)["comm_to_compute"] == pytest.approx(2 * base)
    assert graph_features_on_link(g, bandwidth_Bps=200)["comm_to_compute"] == pytest.approx(base / 2)
    assert graph_features_on_link(g, bandwidth_Bps=math.inf, latency_s=1)["comm_to_compute"] == pytest.approx(1 / 4)
    assert graph_features_on_link(g, bandwidth_Bps=math.inf)["comm_to_compute"] == 0.0  # one device: no transfers


def test_documented_cluster_averages_give_the_mean_over_the_cluster() -> None:
    """The module docstring's recipe for a Cluster: comm_to_compute = (mean over ordered device pairs of the
    total transfer time) / (mean over devices of the total compute time)."""
    g = build([("a", 2), ("b", 3), ("c", 1)], [("a", "b", 100), ("a", "c", 50, 1), ("b", "c", 0)])
    cl = Cluster("het", (Device("g0", 1e9, 1.0), Device("g1", 1e9, 2.0), Device("g2", 1e9, 4.0)), Link(10.0, 0.5),
                 {(0, 1): Link(40.0, 0.1), (2, 0): Link(5.0, 2.0)})
    d = cl.num_devices
    off = ~np.eye(d, dtype=bool)
    f = graph_features_on_link(g, bandwidth_Bps=1 / np.mean(1 / cl.bandwidth[off]),
                               latency_s=float(np.mean(cl.latency[off])), speed=1 / np.mean(1 / cl.speeds))
    pairs = [(a, b) for a in range(d) for b in range(d) if a != b]
    comm = np.mean([sum(cl.pair(a, b).transfer_s(x) for x in (100, 50, 0)) for a, b in pairs])
    compute = np.mean([6 / s for s in cl.speeds])
    assert f["comm_to_compute"] == pytest.approx(comm / compute, rel=1e-12)


@pytest.mark.parametrize("kwargs", [{"bandwidth_Bps": 0}, {"bandwidth_Bps": -1}, {"bandwidth_Bps": math.nan},
                                    {"latency_s": -1}, {"latency_s": math.inf}, {"speed": 0},
                                    {"speed": math.nan}, {"bandwidth_Bps": "fast"}])
def test_bad_comm_parameters(kwargs: dict) -> None:
    g = build([("a", 1)], [])
    with pytest.raises(DevplaceError, match="graph_features_on_link"):
        graph_features_on_link(g, **kwargs)


def test_names_and_descriptions() -> None:
    assert tuple(FEATURE_DESCRIPTIONS) == FEATURE_NAMES
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
    assert all(FEATURE_DESCRIPTIONS[k] for k in FEATURE_NAMES)


# ----------------------------------------------------------------------------- properties on random DAGs


@st.composite
def dags(draw: st.DrawFn) -> CompGraph:
    """Random DAG: edges only from lower to higher topological index, inserted in a shuffled node order."""
    n = draw(st.integers(1, 25))
    compute = draw(st.lists(st.one_of(st.just(0.0), st.floats(1e-9, 1e3)), min_size=n, max_size=n))
    kinds = draw(st.lists(st.sampled_from(["", "forward", "backward", "optimizer", "other"]), min_size=n,
                          max_size=n))
    out = draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n))
    pairs = [(u, v) for v in range(n) for u in range(v)]
    chosen = draw(st.lists(st.sampled_from(pairs), max_size=3 * n, unique=True)) if pairs else []
    edges = []
    for u, v in chosen:
        for t in range(draw(st.integers(1, 2))):  # sometimes a parallel edge (a second tensor)
            edges.append({"src": f"n{u}", "dst": f"n{v}", "bytes": float(out[u]) * (t + 1), "tensor": t})
    order = draw(st.permutations(range(n)))
    nodes = [{"id": f"n{v}", "compute_s": compute[v], "kind": kinds[v], "output_bytes": out[v]} for v in order]
    return CompGraph.build("r", nodes, edges)


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    return list(a) == list(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(
        a.values(), b.values(), strict=True))


@settings(max_examples=200, deadline=None)
@given(dags(), st.floats(1e-3, 1e12), st.floats(0, 1), st.floats(0.1, 10))
def test_properties(g: CompGraph, bw: float, lat: float, speed: float) -> None:
    f = graph_features_on_link(g, bandwidth_Bps=bw, latency_s=lat, speed=speed)
    assert tuple(f) == FEATURE_NAMES
    assert all(type(v) is float for v in f.values())
    assert same(f, graph_features_on_link(g, bandwidth_Bps=bw, latency_s=lat, speed=speed))  # deterministic
    for key in SHARES:
        assert 0.0 <= f[key] <= 1.0, key
    assert f["forward_compute_share"] + f["backward_compute_share"] + f["optimizer_compute_share"] <= 1 + 1e-12
    n = f["nodes"]
    assert 1 <= f["width"] <= n
    assert 0 <= f["depth"] <= n - 1
    assert f["width"] * (f["depth"] + 1) >= n
    assert f["parallelism"] >= 1.0
    assert f["parallelism"] <= n * (1 + 1e-12)  # work / critical path, both float sums
    assert f["top10_compute_share"] >= math.ceil(n / 10) / n - 1e-12  # the largest ops hold at least their share
    assert f["max_in_degree"] <= f["distinct_edges"] <= f["edges"]
    assert f["sources"] >= 1 and f["sinks"] >= 1
    if f["distinct_edges"]:
        assert 1.0 <= f["mean_edge_span"] <= f["depth"]
    if f["total_compute_s"] > 0:
        assert f["comm_to_compute"] >= 0
    else:
        assert math.isnan(f["comm_to_compute"])

    # cross-checks against networkx and the simulator's lower bound
    nxg = nx.DiGraph(g.to_networkx())
    assert f["depth"] == nx.dag_longest_path_length(nxg)
    assert f["max_out_degree"] == max(d for _, d in nxg.out_degree())
    one = Cluster("one", (Device("gpu0", 1e18, 1.0),), Link(1.0, 0.0))
    assert f["critical_path_s"] == pytest.approx(lower_bound(g, one).critical_path_s, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(dags(), st.randoms(use_true_random=False))
def test_insertion_order_does_not_matter(g: CompGraph, rnd) -> None:
    doc = g.to_dict()
    nodes, edges = list(doc["nodes"]), list(doc["edges"])
    rnd.shuffle(nodes)
    rnd.shuffle(edges)
    h = CompGraph.build("r2", nodes, edges)
    a = graph_features_on_link(g, bandwidth_Bps=1e9, latency_s=1e-5)
    b = graph_features_on_link(h, bandwidth_Bps=1e9, latency_s=1e-5)
    for key in FEATURE_NAMES:
        if math.isnan(a[key]):
            assert math.isnan(b[key]), key
        else:
            assert b[key] == pytest.approx(a[key], rel=1e-12), key


@given(st.lists(st.floats(1e-9, 1e3), min_size=1, max_size=60))
def test_chain_parallelism_is_exactly_one(compute: list[float]) -> None:
    edges = [(f"n{i}", f"n{i + 1}", 1) for i in range(len(compute) - 1)]
    g = build([(f"n{i}", c) for i, c in enumerate(compute)], edges)
    f = graph_features_on_link(g)
    assert f["parallelism"] == 1.0
    assert f["width"] == 1 and f["depth"] == len(compute) - 1
