"""`order="auto"`: the shipped order model on any graph, place(..., order="auto"), --try K, and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cluster, graph
from conftest import run_cli as run
from devplace.defaults import CANONICAL_ORDER
from devplace.graph import CompGraph
from devplace.orders import ORDERS, OrderError, check_order_name, traversal_indices, traversal_order
from devplace.orders.auto import OrderModel, candidate_orders, recommend_order, shipped_model
from devplace.placers import PlacerError, get_placer, place
from study_fixture import fixture_rows


@st.composite
def small_dags(draw: st.DrawFn) -> CompGraph:
    """A random DAG (edges from lower to higher index, shuffled insertion order), compute may be all zero."""
    n = draw(st.integers(1, 12))
    perm = draw(st.permutations(range(n)))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n))
    out_bytes = draw(st.lists(st.sampled_from([0.0, 8.0, 1e6]), min_size=n, max_size=n))  # one size per output
    links = dict.fromkeys((min(a, b), max(a, b)) for a, b in pairs if a != b)
    edges = [{"src": f"v{u}", "dst": f"v{v}", "bytes": out_bytes[u]} for u, v in links]
    compute = draw(st.lists(st.sampled_from([0.0, 1e-3, 2.0]), min_size=n, max_size=n))
    return CompGraph.build("dag", [{"id": f"v{i}", "compute_s": compute[i]} for i in perm], edges)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(), st.sampled_from(["greedy", "m-topo", "contiguous", "anneal", "round-robin"]),
       st.booleans())
def test_auto_gives_a_valid_order_for_any_graph(g: CompGraph, placer: str, with_cluster: bool) -> None:
    rec = recommend_order(g, cluster(3) if with_cluster else None, placer=placer)
    assert rec.order in ORDERS and rec.order != "random"
    assert rec.ranking[0] == rec.order and set(rec.ranking) <= set(ORDERS)
    assert rec.rule.endswith(rec.order) or rec.order in rec.rule
    assert sorted(traversal_indices(g, rec.order).tolist()) == list(range(g.num_nodes))


def test_shipped_model_records_its_study() -> None:
    m = shipped_model()
    assert m.doc["fitted_on"]["database"] and m.doc["fitted_on"]["graphs"] > 0
    assert m.placers and "*" in m.doc["placers"]
    for p in m.placers:
        assert m.rules(p)


def test_fallbacks_for_placers_without_rules() -> None:
    g = graph([("a", 1.0), ("b", 2.0)], [("a", "b", 8)])
    doc = OrderModel(json.loads(json.dumps(shipped_model().doc))).doc
    doc["placers"] = {"greedy": doc["placers"]["greedy"]}  # no pooled tree
    m = OrderModel(doc)
    rec = recommend_order(g, cluster(2), placer="seq2seq", model=m)
    assert (rec.order, rec.source) == (CANONICAL_ORDER, "default") and "no rule" in rec.rule
    assert rec.ranking[0] == "topo" and "random" not in rec.ranking and len(rec.ranking) == len(ORDERS) - 1
    assert recommend_order(g, cluster(2), placer="m-etf", model=m, uses_order=False).rule.endswith(
        "does not walk the graph in an order")
    # the shipped model has a pooled tree "*": it orders --try's candidates but does not pick the order
    rec = recommend_order(g, cluster(2), placer="seq2seq")
    assert (rec.order, rec.source, rec.ranking[0]) == ("topo", "default", "topo")
    assert len(set(rec.ranking)) == len(rec.ranking) == len(ORDERS) - 1


def test_auto_is_accepted_only_where_a_placer_takes_an_order() -> None:
    assert check_order_name("auto", allow_auto=True) == "auto"
    with pytest.raises(OrderError, match="not an order"):
        traversal_order(graph([("a", 1.0)], []), "auto")


@pytest.fixture
def chain_fork():
    nodes = [("x", 1.0), ("a", 2.0), ("b", 2.0), ("c", 1.0), ("d", 3.0), ("y", 1.0)]
    edges = [("x", "a", 1e3), ("x", "b", 1e3), ("a", "c", 1e3), ("b", "d", 1e3), ("c", "y", 1e3), ("d", "y", 1e3)]
    return graph(nodes, edges, name="fork")


def _first_best(tried: dict[str, object]) -> str:
    """The order `--order auto` must keep: the smallest step time, the earliest tried (higher-ranked) on ties."""
    times = {o: t for o, t in tried.items() if isinstance(t, float)}
    return min(times, key=lambda o: (times[o], list(tried).index(o)))


@pytest.mark.parametrize("placer", ["greedy", "m-topo", "contiguous", "m-etf", "m-sct"])
def test_cheap_placers_try_every_candidate_order(chain_fork, placer: str) -> None:
    c = cluster(2, bw=1e5)
    p = place(chain_fork, c, placer=placer, order="auto")
    auto = p.meta["order_auto"]
    rec = recommend_order(chain_fork, c, placer=placer)
    candidates = candidate_orders(rec)
    assert get_placer(placer).cheap and auto["mode"] == f"try all {len(candidates)}" and "cheap" in auto["why"]
    assert list(auto["tried"]) == candidates and "random" not in candidates
    assert set(candidates) == set(ORDERS) - {"random"} and candidates[:len(rec.ranking)] == list(rec.ranking)
    assert (auto["model_order"], auto["rule"]) == (rec.order, rec.rule)
    with pytest.raises(PlacerError, match="has no setting 'colour'"):  # a user error is not an order that fails
        place(chain_fork, c, placer=placer, order="auto", colour="blue")
    for o in ("topo", "reversed-topo", "bfs"):  # the tried step times are those of the orders placed directly
        assert auto["tried"][o] == place(chain_fork, c, placer=placer, order=o).meta["step_time_s"]
    best = _first_best(auto["tried"])
    assert auto["order"] == p.made_by.order == best and p.meta["step_time_s"] == min(auto["tried"].values())
    assert p.assignment == place(chain_fork, c, placer=placer, order=best).assignment


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags())
def test_ties_keep_the_models_higher_ranked_order(g: CompGraph) -> None:
    c = cluster(2, bw=1e5)
    auto = place(g, c, placer="m-etf", order="auto").meta["order_auto"]
    assert auto["order"] == _first_best(auto["tried"])
    if len(set(auto["tried"].values())) == 1:  # every order places alike (e.g. one node): the model's first
        assert auto["order"] == recommend_order(g, c, placer="m-etf").ranking[0]


def test_expensive_placers_and_orderless_ones_follow_the_model(chain_fork) -> None:
    c = cluster(2, bw=1e5)
    assert not get_placer("anneal").cheap and not get_placer("placeto").cheap and not get_placer("seq2seq").cheap
    p = place(chain_fork, c, placer="anneal", order="auto", steps=20)
    auto, rec = p.meta["order_auto"], recommend_order(chain_fork, c, placer="anneal")
    assert auto["mode"] == "model" and "tried" not in auto and "not registered cheap" in auto["why"]
    assert auto["order"] == p.made_by.order == rec.order and auto["rule"] == rec.rule
    assert p.assignment == place(chain_fork, c, placer="anneal", order=rec.order, steps=20).assignment
    # try_orders=K still tries the model's top K for an expensive placer
    tried = place(chain_fork, c, placer="anneal", order="auto", steps=20, try_orders=2).meta["order_auto"]["tried"]
    assert list(tried) == list(rec.ranking[:2])
    p = place(chain_fork, c, placer="heft", order="auto")  # heft ignores the order: nothing to try
    auto = p.meta["order_auto"]
    assert p.made_by.order is None and auto["mode"] == "model" and "does not walk" in auto["rule"]


def test_try_k_keeps_the_best_of_the_k_most_promising(chain_fork) -> None:
    c = cluster(2, bw=1e5)
    p = place(chain_fork, c, placer="greedy", order="auto", try_orders=3)
    auto = p.meta["order_auto"]
    ranking = recommend_order(chain_fork, c, placer="greedy").ranking
    assert list(auto["tried"]) == list(ranking[:3])
    assert p.meta["step_time_s"] == min(auto["tried"].values())
    assert auto["order"] == p.made_by.order in ranking[:3]
    with pytest.raises(PlacerError, match="needs order='auto'"):
        place(chain_fork, c, placer="greedy", order="topo", try_orders=2)
    with pytest.raises(PlacerError, match=">= 1"):
        place(chain_fork, c, placer="greedy", order="auto", try_orders=0)


def test_try_with_a_cheap_placer_runs_the_requested_placer_once(chain_fork) -> None:
    c = cluster(2, bw=1e5)
    p = place(chain_fork, c, placer="contiguous", order="auto", try_orders=3, try_with="greedy")
    auto = p.meta["order_auto"]
    ranking = recommend_order(chain_fork, c, placer="contiguous").ranking
    # the orders are tried with greedy (their step times are greedy's), the answer is contiguous's
    assert list(auto["tried"]) == list(ranking[:3]) and auto["tried_with"] == "greedy"
    greedy_times = {o: place(chain_fork, c, placer="greedy", order=o).meta["step_time_s"] for o in ranking[:3]}
    assert auto["tried"] == greedy_times
    best = min(ranking[:3], key=lambda o: (greedy_times[o], ranking.index(o)))
    assert p.made_by.placer == "contiguous" and p.made_by.order == best
    assert p.assignment == place(chain_fork, c, placer="contiguous", order=best).assignment
    with pytest.raises(PlacerError, match="give both"):
        place(chain_fork, c, placer="contiguous", order="auto", try_with="greedy")




def test_cli_recommend(tmp_path, capsys, monkeypatch) -> None:
    code, out, _ = run(["recommend", "example", "--placer", "m-topo", "--json"], capsys, monkeypatch)
    assert code == 0
    doc = json.loads(out)
    assert doc["order"] in ORDERS and doc["rule"] and "expected_gain" in doc
    assert doc["cluster"] == shipped_model().cluster  # no --cluster: the one the model was fitted on
    code, out, _ = run(["recommend", "example", "--placer", "greedy", "-c", "4xV100-16GB"], capsys, monkeypatch)
    assert code == 0 and "rule:" in out and "expected gain over topo" in out
    # another order model, given as a file
    from devplace.study.recommend import fit_order_model

    fit_order_model(fixture_rows()).save(tmp_path / "m.json")
    code, out, _ = run(["recommend", "example", "--order-model", str(tmp_path / "m.json"), "--json"], capsys,
                       monkeypatch)
    assert code == 0 and json.loads(out)["model"] == str(tmp_path / "m.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "devplace.order-model/9"}))
    code, _, err = run(["recommend", "example", "--order-model", str(tmp_path / "bad.json")], capsys, monkeypatch)
    assert code == 2 and "order-model/9" in err


def test_cli_place_order_auto_with_try(capsys, monkeypatch) -> None:
    code, out, _ = run(["place", "example", "-c", "4xV100-16GB", "--placer", "m-topo", "--order", "auto",
                        "--try", "2", "--json"], capsys, monkeypatch)
    assert code == 0
    doc = json.loads(out)
    assert doc["order"] == doc["order_auto"]["order"] and len(doc["order_auto"]["tried"]) == 2
    code, out, _ = run(["place", "example", "-c", "4xV100-16GB", "--placer", "m-topo", "--order", "auto", "--json"],
                       capsys, monkeypatch)  # m-topo is cheap: every candidate order is tried
    doc = json.loads(out)
    assert code == 0 and doc["order_auto"]["mode"].startswith("try all") and doc["order"] == doc["order_auto"]["order"]
    code, _, err = run(["place", "example", "-c", "4xV100-16GB", "--order", "topo", "--try", "2"], capsys,
                       monkeypatch)
    assert code == 2 and "--order auto" in err


@pytest.mark.parametrize("placer", ["m-topo", "contiguous", "greedy"])
def test_place_takes_an_explicit_or_callable_order(placer: str) -> None:
    g = graph([("a", 1.0), ("b", 2.0), ("c", 1.0), ("d", 3.0)],
              [("a", "b", 8.0), ("a", "c", 8.0), ("b", "d", 8.0), ("c", "d", 8.0)])
    named = place(g, cluster(2), placer=placer, order="dfs-postorder")
    ids = traversal_order(g, "dfs-postorder")
    for custom in (ids, tuple(ids), lambda graph: traversal_order(graph, "dfs-postorder")):
        p = place(g, cluster(2), placer=placer, order=custom)
        assert p.assignment == named.assignment
        assert p.made_by.order == "custom"
    with pytest.raises(OrderError, match="missing 'd'"):
        place(g, cluster(2), placer=placer, order=["a", "b", "c"])
    with pytest.raises(PlacerError, match=r"needs order='auto'.*'custom'"):
        place(g, cluster(2), placer=placer, order=ids, try_orders=2)


def three_branches():
    """A graph of three uneven branches, its coarsening to 7 groups and a 3-device cluster."""
    from devplace.graph.coarsen import coarsen

    nodes = [(f"{b}{i}", 1.0 + ((3 * i + len(b)) % 4)) for b in ("p", "qq", "rrr") for i in range(6)]
    edges = [(f"{b}{i}", f"{b}{i + 1}", 4e8) for b in ("p", "qq", "rrr") for i in range(5)]
    edges += [("p0", "qq0", 4e8), ("p0", "rrr0", 4e8), ("qq5", "p5", 4e8), ("rrr5", "p5", 4e8)]
    full = graph(nodes, edges, name="three")
    return full, coarsen(full, 7), cluster(3, bw=1e9)


@pytest.mark.parametrize("placer", ["m-etf", "contiguous"])
def test_auto_on_a_coarsened_graph_compares_the_orders_on_the_full_graph(placer) -> None:
    from devplace.placers import place_expanded

    full, coarsening, c = three_branches()
    ex = place_expanded(coarsening, full, c, placer=placer, order="auto")
    auto = ex.placement.meta["order_auto"]
    assert auto == ex.coarse.meta["order_auto"] and "of the full graph" in auto["why"]
    tried = auto["tried"]
    assert len(tried) == len(candidate_orders(recommend_order(coarsening.graph, c, placer=placer)))
    for name, step in tried.items():  # each the full graph's step under that order, not the coarse graph's
        assert step == place_expanded(coarsening, full, c, placer=placer, order=name).result.step_time_s
    assert ex.result.step_time_s == min(tried.values()) and auto["order"] == _first_best(tried)


def test_auto_on_a_coarsened_graph_falls_back_to_the_coarse_choice_when_no_order_fits_alone(monkeypatch) -> None:
    # where every order alone is NoFitError on the full graph, auto chooses again on the coarse graph at every
    # lowered cap (as before the full-graph comparison), which can fit where no fixed order does
    import devplace.placers.search as search
    from devplace.placers import NoFitError, place_expanded

    placed = search.place_candidate

    def no_order_fits_alone(req, placer, orders, settings, progress):
        if len(orders) == 1:
            raise NoFitError("no order fits alone")
        return placed(req, placer, orders, settings, progress)

    full, coarsening, c = three_branches()
    monkeypatch.setattr(search, "place_candidate", no_order_fits_alone)
    ex = place_expanded(coarsening, full, c, placer="m-etf", order="auto")
    auto = ex.placement.meta["order_auto"]
    assert ex.result.feasible and "of the full graph" not in auto["why"] and auto["mode"].startswith("try all")
