"""Placement semantics (issue 22): op by op or as autograd runs, carried by the graph, followed by `place`, the
study and the learned placers, overridden by one option; learned placers judged on the graph that runs."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cluster, graph, run_cli
from devplace.errors import DevplaceError
from devplace.graph import load_graph, save_graph
from devplace.graph.compgraph import CompGraph
from devplace.graph.semantics import Semantics, SemanticsError, semantics_of
from devplace.graph.ties import fold, tie_classes, violations
from devplace.placers import place
from devplace.sim import DevplaceModel
from devplace.study.grid import expand
from devplace.study.spec import StudyError, parse_study
from devplace.zoo import layered_graph


def _with(g: CompGraph, semantics: str | None, **node_keys: str) -> CompGraph:
    """`g` with meta "semantics" (None: none) and the extra node keys given for every node."""
    meta = {**g.meta, **({"semantics": semantics} if semantics is not None else {})}
    return CompGraph.build(g.name, [{**g.node_record(v), **node_keys} for v in range(g.num_nodes)],
                           [g.edge_record(e) for e in range(g.num_edges)], meta=meta)


def _all_tied(semantics: str | None) -> CompGraph:
    """A 30-node graph with parallel work and every node in one tie class: under autograd one unit."""
    return _with(layered_graph(30, width=4, fan_in=2, seed=1), semantics, tie="one")


def test_the_graph_says_which_and_an_override_wins():
    assert semantics_of(_all_tied(None)) is Semantics.OP_BY_OP  # says nothing: op by op
    assert semantics_of(_all_tied("autograd")) is Semantics.AUTOGRAD
    assert semantics_of(_all_tied("autograd"), "op-by-op") is Semantics.OP_BY_OP
    assert semantics_of(_all_tied(None), Semantics.AUTOGRAD) is Semantics.AUTOGRAD


def test_an_unknown_value_is_a_user_error_naming_the_choices():
    with pytest.raises(SemanticsError, match="op-by-op, autograd") as err:
        semantics_of(_all_tied("ties"))
    assert isinstance(err.value, DevplaceError) and "--semantics" in str(err.value)
    with pytest.raises(SemanticsError, match="'by-op'"):
        place(_all_tied(None), cluster(3), placer="m-etf", order="topo", semantics="by-op")


def test_place_follows_the_graph_and_records_it():
    c = cluster(3, bw=1e12, mem=1e12)
    op = place(_all_tied(None), c, placer="m-etf", order="topo")
    assert op.made_by.semantics == "op-by-op" and "tie_classes" not in op.meta
    assert len(set(op.assignment.values())) > 1  # parallel work spread: every node a decision
    ag = place(_all_tied("autograd"), c, placer="m-etf", order="topo")
    assert ag.made_by.semantics == "autograd" and ag.meta["tie_classes"] == 1
    assert len(set(ag.assignment.values())) == 1
    over = place(_all_tied("autograd"), c, placer="m-etf", order="topo", semantics="op-by-op")
    assert over.assignment == op.assignment


def test_the_semantics_survives_a_json_round_trip(tmp_path):
    save_graph(_all_tied("autograd"), tmp_path / "g.json")
    assert semantics_of(load_graph(tmp_path / "g.json")) is Semantics.AUTOGRAD


def test_cli_place_overrides_the_graphs_semantics(tmp_path, capsys, monkeypatch):
    import json

    save_graph(_all_tied("autograd"), tmp_path / "g.json")
    args = ["place", str(tmp_path / "g.json"), "-c", "3xGPU-placeto", "--placer", "m-etf", "--json", "-q"]
    code, out, _ = run_cli(args, capsys, monkeypatch)
    assert code == 0 and json.loads(out)["semantics"] == "autograd"
    code, out, _ = run_cli([*args, "--semantics", "op-by-op"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["semantics"] == "op-by-op"
    code, _, err = run_cli([*args, "--semantics", "tied"], capsys, monkeypatch)
    assert code == 2 and "op-by-op" in err


# ------------------------------------------------------------------------------------------------ study


STUDY = """
name = "s"
graphs = ["g.json"]
clusters = ["3xGPU-placeto"]
placers = [{{name = "m-etf"}}]
{extra}
"""


def test_a_study_records_the_semantics_in_its_keys(tmp_path):
    save_graph(_all_tied(None), tmp_path / "g.json")
    keys = {}
    for extra in ("", 'semantics = "op-by-op"', 'semantics = "autograd"'):
        spec = parse_study(STUDY.format(extra=extra), base_dir=tmp_path)
        keys[extra] = expand(spec)[0]
    assert keys[""].semantics is None and keys['semantics = "autograd"'].semantics == "autograd"
    assert len({c.key for c in keys.values()}) == 3  # the override is part of what a cell computes
    with pytest.raises(StudyError, match="unknown placement semantics"):
        parse_study(STUDY.format(extra='semantics = "x"'), base_dir=tmp_path)


# ------------------------------------------------------------------------------------------------ learned placers


def test_the_learned_placers_start_op_by_op_when_the_caller_places_op_by_op():
    # a graph captured as autograd runs (one tie class) placed op by op: the classic placers the learned one
    # starts from must place it op by op too, or it starts from one device (it did: issue 22)
    from devplace.placers.rl.start import best_classic

    g, c = _all_tied("autograd"), cluster(3, bw=1e12, mem=1e12)
    metf = place(g, c, placer="m-etf", order="topo", semantics="op-by-op").meta["step_time_s"]
    _, result, _ = best_classic(g, c, DevplaceModel(g, c))
    assert result.step_time_s <= metf
    learned = place(g, c, placer="placeto", order="topo", semantics="op-by-op", episodes=1, hidden=8, rounds=2)
    assert learned.meta["step_time_s"] <= metf


def _misleading_fold() -> CompGraph:
    """a -> {b, c} -> d with a and d tied (autograd): the fold keeps a -> b and a -> c only, so it does not see
    the 1 GB that c sends to d. In the fold, b and c on two devices overlap; as run, c's output crosses back."""
    g = graph([("a", 0.1), ("b", 1.0), ("c", 1.0), ("d", 0.1)],
              [("a", "b", 1.0), ("a", "c", 1.0), ("b", "d", 1.0), ("c", "d", 1e9)])
    nodes = [{**g.node_record(v), **({"tie": "ad"} if g.ids[v] in ("a", "d") else {})} for v in range(g.num_nodes)]
    return CompGraph.build(g.name, nodes, [g.edge_record(e) for e in range(g.num_edges)],
                           meta={"semantics": "autograd"})


@pytest.mark.parametrize("placer", ["placeto", "seq2seq"])
def test_a_learned_answer_is_never_worse_than_one_device_on_the_graph_that_runs(placer):
    g, c = _misleading_fold(), cluster(2, bw=1e9, mem=1e12)
    model = DevplaceModel(g, c)
    one = min(model.run(np.full(4, d, dtype=np.int64)).step_time_s for d in range(2))
    folded = fold(g).graph
    view_split = DevplaceModel(folded, c).run(np.array([0, 0, 1]))  # b and c apart: better in the fold
    assert view_split.step_time_s < DevplaceModel(folded, c).run(np.zeros(3, dtype=np.int64)).step_time_s
    settings = {"episodes": 1, "hidden": 8, "rounds": 2} if placer == "placeto" else {"episodes": 1, "samples": 2}
    p = place(g, c, placer=placer, order="topo", seed=0, **settings)
    assert p.meta["ties"] == "folded"
    assert p.meta["step_time_s"] <= one
    assert violations(g, p.to_array(g, 2), tie_classes(g)) == []


def test_family_training_places_tie_classes_and_judges_on_the_graph_itself():
    from devplace.placers.rl.trainer import train

    g, c = _misleading_fold(), cluster(2, bw=1e9, mem=1e12)
    result = train([g], c, episodes=1, hidden=8, rounds=2, seed=0)
    devices, step = result.best[g.name]
    assert len(devices) == g.num_nodes and violations(g, devices, tie_classes(g)) == []
    assert step == DevplaceModel(g, c).run(devices).step_time_s
    one = min(DevplaceModel(g, c).run(np.full(4, d, dtype=np.int64)).step_time_s for d in range(2))
    assert step <= one and step <= result.start_step_time_s[g.name]
    op = train([g], c, episodes=1, hidden=8, rounds=2, seed=0, semantics="op-by-op")
    assert len(op.best[g.name][0]) == g.num_nodes


def test_the_seed_preset_keeps_the_seeds_design():
    from devplace.study.spec import load_study

    spec = load_study("seed", preset=True)
    assert spec.semantics == "op-by-op" and spec.sim_model == "placeto" and spec.seeds == (0, 1, 2)
    assert {g.family for g in spec.graphs} == {"cifar10", "ptb", "nmt"} and len(spec.graphs) == 12
    assert set(spec.orders) == {"lexicographic", "topo", "reversed-topo", "dfs-preorder", "dfs-postorder", "bfs"}
    placeto = next(p for p in spec.placers if p.name == "placeto")
    assert placeto.settings["episodes"] == 50
    cells = expand(spec)
    assert len(cells) == 12 * 6 * (3 + 4) + 12 * 4 and all(c.semantics == "op-by-op" for c in cells)  # + baselines
