"""The recommendation model: a deterministic shallow regret tree, its validation, and the model JSON."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from devplace.errors import FormatError
from devplace.orders.auto import ORDER_MODEL_FORMAT, OrderModel, OrderModelError
from devplace.study.analysis import build_units
from devplace.study.recommend import MAX_DEPTH, Dataset, fit_order_model, fit_tree, make_dataset, predict, validate
from study_fixture import fixture_rows


def greedy_units() -> list:
    return [u for u in build_units(fixture_rows()) if u.placer == "greedy"]


def depth(node: dict) -> int:
    return 0 if "order" in node else 1 + max(depth(node["le"]), depth(node["gt"]))


def test_tree_splits_on_the_separating_feature() -> None:
    data = make_dataset(greedy_units())
    assert "random" not in data.orders and data.dropped == 0
    tree = fit_tree(data)
    assert tree["feature"] == "branching_share" and 0.2 < tree["threshold"] < 0.6
    assert tree["le"]["order"] == "bfs" and tree["gt"]["order"] == "topo"
    assert tree["le"]["gain"] == pytest.approx(0.25, abs=0.01)  # topo is 25 % slower in family fa
    assert tree["gt"]["gain"] == pytest.approx(0.0, abs=1e-9) and tree["gt"]["regret"] < 0.01
    assert tree["le"]["ranking"][:2] == ["bfs", "dfs-preorder"]


def test_tree_fitting_is_deterministic() -> None:
    units = greedy_units()
    first = fit_tree(make_dataset(units))
    shuffled = units[:]
    random.Random(3).shuffle(shuffled)
    assert fit_tree(make_dataset(shuffled)) == first
    assert fit_order_model(fixture_rows()).doc == fit_order_model(list(reversed(fixture_rows()))).doc


def test_tree_depth_is_bounded_and_ties_go_to_topo() -> None:
    rng = np.random.default_rng(0)
    n, orders = 60, ["topo", "bfs", "dfs-preorder"]
    X = rng.random((n, 4))
    R = 1 + rng.random((n, 3))
    R = R / R.min(axis=1, keepdims=True)
    tree = fit_tree(Dataset([object()] * n, orders, ["a", "b", "c", "d"], X, R, 0), min_gain=0.0, min_leaf=1)
    assert 1 <= depth(tree) <= MAX_DEPTH
    # every order equally good: a single leaf, and the tie goes to topo
    flat = Dataset([object()] * n, orders, ["a"], X[:, :1], np.ones((n, 3)), 0)
    assert fit_tree(flat) == {"order": "topo", "ranking": orders, "gain": 0.0, "regret": 0.0, "graphs": n}


def test_nan_features_go_left() -> None:
    tree = {"feature": "x", "threshold": 0.5, "le": {"order": "bfs"}, "gt": {"order": "topo"}}
    assert predict(tree, {"x": float("nan")})["order"] == "bfs"
    assert predict(tree, {"x": 0.7})["order"] == "topo"


def test_validation_leave_one_graph_and_one_family_out() -> None:
    units = greedy_units()
    logo = validate(units, lambda u: u.graph)
    assert logo["groups"] == 12 and logo["units"] == 12
    assert logo["accuracy"] == 1.0 and logo["regret"] == pytest.approx(0.0, abs=0.003)
    assert logo["topo_regret"] == pytest.approx(0.125, abs=0.01)  # topo loses 25 % on half the graphs
    # holding out a whole family leaves only the other family's order to learn: it is wrong on every graph
    lofo = validate(units, lambda u: u.family)
    assert lofo["groups"] == 2 and lofo["accuracy"] == 0.0
    assert lofo["regret"] > logo["regret"]
    assert {p["predicted"] for p in lofo["per_unit"] if p["family"] == "fa"} == {"topo"}


def test_model_json_round_trip(tmp_path) -> None:
    model = fit_order_model(fixture_rows(), fitted_on={"database": "fixture.sqlite"})
    assert model.doc["format"] == ORDER_MODEL_FORMAT
    assert model.doc["fitted_on"]["database"] == "fixture.sqlite" and model.cluster == "3xGPU-placeto"
    assert set(model.doc["placers"]) == {"greedy", "m-topo", "placeto", "*"}
    path = tmp_path / "m.json"
    model.save(path)
    again = OrderModel.load(path)
    assert again.doc == model.doc
    feats = {"branching_share": 0.15}
    assert again.recommend(feats, "greedy").order == model.recommend(feats, "greedy").order == "bfs"
    assert model.rules("greedy")[0].startswith("branching_share <= ")


def test_model_loader_rejects_other_versions_and_bad_trees(tmp_path) -> None:
    doc = fit_order_model(fixture_rows()).doc
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "format": "devplace.order-model/2"}))
    with pytest.raises(FormatError, match=r"order-model/1.*devplace.order-model/2"):
        OrderModel.load(bad)
    bad.write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        OrderModel.load(bad)
    broken = json.loads(json.dumps(doc))
    broken["placers"]["greedy"]["tree"] = {"order": "sideways"}
    with pytest.raises(OrderModelError, match="unknown order 'sideways'"):
        OrderModel(broken)
    broken["placers"]["greedy"]["tree"] = {"feature": "x", "le": {"order": "topo"}}
    with pytest.raises(OrderModelError, match="threshold"):
        OrderModel(broken)


def test_selection_keeps_a_tree_that_generalises_and_drops_one_that_does_not() -> None:
    from devplace.study.recommend import select_tree

    tree, sel = select_tree(make_dataset(greedy_units()))
    assert sel["chosen"] == "depth 1" and tree["feature"] == "branching_share"
    assert sel["scores"]["depth 1"] < sel["scores"]["topo"]
    # no signal: the relative step times do not follow the features, so no tree beats the simple answers
    rng = np.random.default_rng(1)
    units = greedy_units()
    n = len(units)
    noise = Dataset(units, ["topo", "bfs"], ["a"], rng.random((n, 1)), np.c_[np.ones(n), 1 + 0.3 * rng.random(n)], 0)
    tree, sel = select_tree(noise)
    assert sel["chosen"] in ("topo", "depth 0") and tree["order"] == "topo"


def test_rules_merge_conditions_on_one_feature() -> None:
    leaf = {"order": "topo"}
    tree = {"feature": "x", "threshold": 1.0, "le": leaf,
            "gt": {"feature": "x", "threshold": 2.0, "le": {"order": "bfs"}, "gt": leaf}}
    doc = {"format": "devplace.order-model/1", "placers": {"greedy": {"tree": tree}}}
    assert OrderModel(doc).rules("greedy") == ["x <= 1 -> topo (gain over topo +0.00%, 0 graphs)",
                                               "1 < x <= 2 -> bfs (gain over topo +0.00%, 0 graphs)",
                                               "x > 2 -> topo (gain over topo +0.00%, 0 graphs)"]
