"""The recommendation model: from graph features to the best traversal order, one shallow tree per placer.

The tree is written here (no scikit-learn) and chosen to be read: depth <= 3, axis-aligned splits
"feature <= threshold", every leaf one order. It is a *regret* tree: a leaf predicts the order with the
smallest mean relative step time over its training units (see `analysis`), and a split is the one that most
lowers the summed relative step time of the two sides' predictions. That fits the goal (a fast step, not the
exact label: two orders often tie, and predicting either is then right) better than a label-impurity tree.
Deterministic: features are tried in `TREE_FEATURES` order, thresholds ascending, and only a strictly better
split replaces the current one; a leaf's ties go to the earlier order of DESIGN.md's table (`topo` first).
A NaN feature is treated as -inf (it goes to the "<=" side), as `devplace.orders.auto` evaluates it.

The tree's complexity is chosen on held-out graphs (`select_tree`): always `topo`, one fixed order, or a tree
of depth 1..3, whichever has the lowest leave-one-graph-out regret, so a tree that only memorises its
training graphs is not shipped. `fit_order_model(rows)` gives the model document (`devplace.order-model/1`, evaluated by
`devplace.orders.auto`), `validate(units, groups)` the leave-one-group-out accuracy and regret.
The order `random` is not a candidate: a seeded permutation is no rule to recommend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from devplace.defaults import CANONICAL_ORDER
from devplace.orders.auto import ORDER_MODEL_FORMAT, POOLED, OrderModel
from devplace.study.analysis import Unit, build_units, complete_units, order_sort_key, orders_of, units_by_placer

# The features a tree may test: the size-free ones (ratios, shares, shapes). Counts such as nodes, edges or depth
# change with how far a graph is coarsened (`--max-nodes`), so a threshold on them would not carry over from the
# study's graphs to a user's graph coarsened differently.
TREE_FEATURES: tuple[str, ...] = (
    "mean_degree", "branching_share", "merging_share", "skip_edge_share", "parallelism", "top10_compute_share",
    "compute_cv", "forward_compute_share", "backward_compute_share", "optimizer_compute_share",
    "edge_bytes_per_output_byte", "comm_to_compute",
)
MAX_DEPTH = 3
MIN_LEAF = 3  # units on each side of a split
MIN_GAIN = 0.002  # a split must lower the mean relative step time of the node's units by at least 0.2 %
# Not candidates of the recommender: `random` is no order; `lexicographic` sorts by node id, so what it does depends
# on how the ops are named (module paths, numbering), which no graph feature sees. On the quick study it won
# cifar10 for contiguous and m-topo, and the tree fitted with it picked it for zoo models where it lost to
# `topo` in 6 of 10 (placer, model) pairs (docs/study/README.md). `auto` (a study may name it) is the decision
# itself, not an order to recommend.
EXCLUDED_ORDERS = ("random", "lexicographic", "auto")


@dataclass(frozen=True)
class Dataset:
    """The units one tree is fitted on: features X (units x features), relative step times R
    (units x orders), the candidate orders and feature names."""

    units: list[Unit]
    orders: list[str]
    features: list[str]
    X: np.ndarray
    R: np.ndarray
    dropped: int  # units without a usable mean for every candidate order


def make_dataset(units: Sequence[Unit], features: Sequence[str] = TREE_FEATURES) -> Dataset:
    """Candidate orders = the orders present in `units` but EXCLUDED_ORDERS; keep the units complete for them."""
    orders = [o for o in orders_of(units) if o not in EXCLUDED_ORDERS]
    done, dropped = complete_units(units, orders)
    feats = [f for f in features if any(f in u.features for u in done)] if done else list(features)
    X = np.array([[u.features.get(f, math.nan) for f in feats] for u in done], dtype=np.float64).reshape(
        len(done), len(feats))
    R = np.array([[u.relative()[o] for o in orders] for u in done], dtype=np.float64).reshape(len(done), len(orders))
    return Dataset(list(done), orders, feats, X, R, dropped)


def _leaf(R: np.ndarray, orders: list[str]) -> dict[str, Any]:
    mean = R.mean(axis=0)
    # ties: the earliest candidate (candidates are in DESIGN.md's table order, so topo first)
    rank = sorted(range(len(orders)), key=lambda j: (round(float(mean[j]), 12), j))
    j = rank[0]
    topo = orders.index(CANONICAL_ORDER) if CANONICAL_ORDER in orders else None
    gain = float(np.mean(R[:, topo] / R[:, j]) - 1) if topo is not None else 0.0
    return {"order": orders[j], "ranking": [orders[i] for i in rank], "gain": gain,
            "regret": float(mean[j] - 1), "graphs": int(R.shape[0])}


def _best_split(X: np.ndarray, R: np.ndarray, min_leaf: int) -> tuple[float, int, float] | None:
    """(loss, feature index, threshold) of the split with the smallest summed relative step time, or None."""
    n = X.shape[0]
    best: tuple[float, int, float] | None = None
    k = np.arange(1, n)  # left side = the first k units in feature order
    for f in range(X.shape[1]):
        x = np.where(np.isnan(X[:, f]), -np.inf, X[:, f])
        idx = np.argsort(x, kind="stable")
        xs = x[idx]
        csum = np.cumsum(R[idx], axis=0)[:-1]
        loss = csum.min(axis=1) + (csum[-1] + R[idx[-1]] - csum).min(axis=1) if n > 1 else np.empty(0)
        # sizes >= min_leaf on both sides, and a threshold must separate unequal values
        ok = (k >= min_leaf) & (k <= n - min_leaf) & (xs[:-1] != xs[1:])
        if not ok.any():
            continue
        m = float(loss[ok].min())
        if best is not None and not m < best[0] - 1e-12:
            continue
        j = int(np.flatnonzero(ok & (loss <= m + 1e-12))[0])  # near-ties: the lowest threshold
        lo, hi = xs[j], xs[j + 1]
        thr = float(hi - 1.0) if math.isinf(lo) else float((lo + hi) / 2)
        if thr >= hi:  # the midpoint of two adjacent floats can round up to the larger one
            thr = float(lo)
        best = (m, f, thr)
    return best


def fit_tree(data: Dataset, *, max_depth: int = MAX_DEPTH, min_leaf: int = MIN_LEAF,
             min_gain: float = MIN_GAIN) -> dict[str, Any]:
    """Fit the regret tree on `data` (see the module docstring); returns the JSON tree of `orders.auto`."""
    if not data.units:
        raise ValueError("no complete unit to fit on")
    n_root = data.R.shape[0]

    def grow(rows: np.ndarray, depth: int) -> dict[str, Any]:
        R, X = data.R[rows], data.X[rows]
        leaf = _leaf(R, data.orders)
        if depth >= max_depth or len(rows) < 2 * min_leaf:
            return leaf
        here = float(R.mean(axis=0).min() * len(rows))
        split = _best_split(X, R, min_leaf)
        # the gain threshold is relative to the whole training set, so small nodes need a large effect
        if split is None or here - split[0] < min_gain * n_root:
            return leaf
        _, f, thr = split
        x = np.where(np.isnan(X[:, f]), -np.inf, X[:, f])
        return {"feature": data.features[f], "threshold": thr,
                "le": grow(rows[x <= thr], depth + 1), "gt": grow(rows[x > thr], depth + 1)}

    return grow(np.arange(n_root), 0)


def predict(tree: dict[str, Any], features: dict[str, float]) -> dict[str, Any]:
    """The leaf of `tree` reached by `features` (NaN goes to "<=")."""
    node = tree
    while "order" not in node:
        x = features.get(node["feature"], math.nan)
        node = node["le"] if math.isnan(x) or x <= node["threshold"] else node["gt"]
    return node


def _subset(data: Dataset, rows: Sequence[int]) -> Dataset:
    idx = list(rows)
    return Dataset([data.units[i] for i in idx], data.orders, data.features, data.X[idx], data.R[idx], 0)


def _topo_leaf(data: Dataset) -> dict[str, Any]:
    """A leaf that always answers `topo` (the ranking after it as `_leaf` orders it)."""
    leaf = _leaf(data.R, data.orders)
    t = data.orders.index(CANONICAL_ORDER)
    ranking = [CANONICAL_ORDER, *(o for o in leaf["ranking"] if o != CANONICAL_ORDER)]
    return {**leaf, "order": CANONICAL_ORDER, "ranking": ranking, "gain": 0.0, "regret": float(data.R[:, t].mean() - 1)}


def _graph_out_regret(data: Dataset, make: Callable[[Dataset], dict[str, Any]]) -> float:
    """Mean regret on held-out graphs (leave-one-graph-out) of the trees `make` fits."""
    graphs = sorted({u.graph for u in data.units})
    total = 0.0
    for g in graphs:
        test = [i for i, u in enumerate(data.units) if u.graph == g]
        tree = make(_subset(data, [i for i, u in enumerate(data.units) if u.graph != g]))
        for i in test:
            order = predict(tree, dict(zip(data.features, data.X[i].tolist(), strict=True)))["order"]
            total += float(data.R[i, data.orders.index(order)] - 1)
    return total / len(data.units)


def select_tree(data: Dataset, *, max_depth: int = MAX_DEPTH, min_leaf: int = MIN_LEAF,
                min_gain: float = MIN_GAIN) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tree with the complexity that does best on held-out graphs, and the scores behind the choice.

    Candidates, simplest first: always `topo`, one fixed order (depth 0), trees of depth 1..max_depth; each is
    scored by its leave-one-graph-out regret on `data`, and the lowest wins (ties within 1e-9: the simpler).
    A tree that only fits its training graphs so loses to a fixed order or to `topo`. With fewer than 3
    graphs there is nothing to hold out, and the full-depth tree is returned."""
    full = {"max_depth": max_depth, "min_leaf": min_leaf, "min_gain": min_gain}
    if len({u.graph for u in data.units}) < 3:
        return fit_tree(data, **full), {"chosen": f"depth {max_depth}", "scores": {}}
    makers: dict[str, Callable[[Dataset], dict[str, Any]]] = {}
    if CANONICAL_ORDER in data.orders:
        makers["topo"] = _topo_leaf
    for d in range(max_depth + 1):
        makers[f"depth {d}"] = lambda sub, d=d: fit_tree(sub, **{**full, "max_depth": d})
    scores = {name: _graph_out_regret(data, make) for name, make in makers.items()}
    best = min(scores.values())
    chosen = next(name for name in makers if scores[name] <= best + 1e-9)
    return makers[chosen](data), {"chosen": chosen, "scores": scores}


def validate(units: Sequence[Unit], group_of: Callable[[Unit], str], *, select: bool = True, try_k: int = 3,
             **fit_options: Any) -> dict[str, Any]:
    """Leave-one-group-out validation: for every group g, fit on the other groups' units and predict g's.

    Returns the held-out accuracy (predicted == the unit's best order; a tie with the best counts as right)
    and mean regret (rel. step time of the predicted order - 1) of the tree, of always `topo`, and of the
    single order best on the training units (a depth-0 tree), plus per-unit predictions. The per-graph
    oracle's regret is 0 by definition. `try_regret` is the regret of `--try try_k`: the best of the
    leaf's `try_k` highest-ranked orders, measured as the study measured them. With `select` (the default, as
    `fit_order_model` fits), each fold chooses the tree's complexity by `select_tree` on its own training units
    only (nested validation)."""
    data = make_dataset(units)
    groups = sorted({group_of(u) for u in data.units})
    per_unit: list[dict[str, Any]] = []
    for g in groups:
        train = [i for i, u in enumerate(data.units) if group_of(u) != g]
        test = [i for i, u in enumerate(data.units) if group_of(u) == g]
        if not train:
            continue
        sub = _subset(data, train)
        tree = select_tree(sub, **fit_options)[0] if select else fit_tree(sub, **fit_options)
        fixed = _leaf(sub.R, sub.orders)["order"]
        for i in test:
            u = data.units[i]
            feats = dict(zip(data.features, data.X[i].tolist(), strict=True))
            leaf = predict(tree, feats)
            pred = leaf["order"]
            rel = dict(zip(data.orders, data.R[i].tolist(), strict=True))
            tried = leaf.get("ranking", [pred])[:try_k]
            per_unit.append({"group": g, "graph": u.graph, "family": u.family, "predicted": pred,
                             "best": min(rel, key=lambda o: (rel[o], order_sort_key(o))),
                             "regret": rel[pred] - 1, "try_regret": min(rel[o] for o in tried) - 1,
                             "topo_regret": rel.get(CANONICAL_ORDER, math.nan) - 1,
                             "fixed": fixed, "fixed_regret": rel[fixed] - 1,
                             "hit": rel[pred] <= min(rel.values()) * (1 + 1e-12)})
    n = len(per_unit)

    def avg(key: str) -> float:
        return float(np.mean([p[key] for p in per_unit])) if n else math.nan

    return {"groups": len(groups), "units": n, "dropped": data.dropped,
            "accuracy": avg("hit"), "regret": avg("regret"), "try_regret": avg("try_regret"), "try_k": try_k,
            "topo_regret": avg("topo_regret"),
            "fixed_regret": avg("fixed_regret"),
            "topo_accuracy": float(np.mean([p["topo_regret"] <= 1e-12 for p in per_unit])) if n else math.nan,
            "per_unit": per_unit}


def fit_order_model(rows: Sequence[dict[str, Any]], *, fitted_on: dict[str, Any] | None = None,
                    **fit_options: Any) -> OrderModel:
    """Fit one tree per placer (units of every family, cluster and setting) and a pooled tree "*" over all
    placers, from a study's rows. `fitted_on` (database, study, ...) is recorded in the model."""
    units = build_units(rows)
    if not units:
        raise ValueError("no row of a placer that uses an order; nothing to fit")
    placers: dict[str, Any] = {}
    for placer, us in [*units_by_placer(units).items(), (POOLED, units)]:
        data = make_dataset(us)
        if not data.units:
            continue
        tree, selection = select_tree(data, **fit_options)
        placers[placer] = {"tree": tree, "units": len(data.units), "dropped": data.dropped, "orders": data.orders,
                           "selection": selection}
    clusters: dict[str, int] = {}
    for u in units:
        clusters[u.cluster] = clusters.get(u.cluster, 0) + 1
    cluster = max(sorted(clusters), key=lambda c: clusters[c])
    info = {"rows": len(rows), "units": len(units), "graphs": len({u.graph for u in units}),
            "families": sorted({u.family for u in units}), "clusters": sorted(clusters),
            "sim_models": sorted({u.sim_model for u in units}), **(fitted_on or {})}
    doc = {"format": ORDER_MODEL_FORMAT, "fitted_on": info, "cluster": cluster,
           "settings": {"max_depth": fit_options.get("max_depth", MAX_DEPTH),
                        "min_leaf": fit_options.get("min_leaf", MIN_LEAF),
                        "min_gain": fit_options.get("min_gain", MIN_GAIN)},
           "features": list(TREE_FEATURES), "placers": placers}
    return OrderModel(doc, "fitted model")
