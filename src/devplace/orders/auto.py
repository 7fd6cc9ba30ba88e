"""`--order auto`: apply a saved order-recommendation model (a shallow decision tree per placer) to a graph.

The model is fitted by `devplace.study.recommend` on a study's results and saved as JSON
(`"format": "devplace.order-model/1"`); the one shipped in the package is `devplace/data/order_model.json`.
This module only reads and evaluates such a model, so it sits with the orders, below the placers:
it imports `graph/`, `hardware/` and `orders/` only.

Model file::

    {"format": "devplace.order-model/1",
     "fitted_on": {"database": "...", "study": "...", ...},     # provenance, free-form
     "cluster": "3xGPU-placeto",                                 # cluster used for features when none is given
     "features": ["nodes", ...],                                 # features the trees may test
     "placers": {"greedy": {"tree": NODE, ...}, "*": {"tree": NODE, ...}}}

    NODE = {"feature": "depth", "threshold": 12.5, "le": NODE, "gt": NODE}      # a split
         | {"order": "bfs", "ranking": ["bfs", "topo", ...], "gain": 0.031,    # a leaf
            "regret": 0.004, "graphs": 17}

A split sends a graph to `le` when its feature is <= threshold, and also when the feature is NaN (undefined,
treated as -inf, as the fitting does). A leaf's `order` is the order with the smallest mean step time over
the training graphs that reach it, `ranking` all candidate orders from best to worst there, `gain` the mean
of step_time(topo) / step_time(order) - 1 over those graphs (the expected gain over `topo`), `regret` the mean
of step_time(order) / step_time(best order of the graph) - 1.

Fallbacks (documented in docs/study.md): a placer that does not walk the graph in an order gets `topo`
(the order is irrelevant); a placer without its own tree (the study did not run it) gets `topo` too,
DESIGN.md's canonical order, and `--try K` then tries topo and the next K-1 orders of the pooled tree `"*"`'s
ranking (fitted on every placer of the study; DESIGN.md's table order when there is none), `random` left
out. The pooled tree is not used to pick the order itself: it extrapolates other placers' order effects.

How `place(..., order="auto")` uses a recommendation (`devplace.placers.search`, `auto_orders`): a placer
registered `cheap` (`@register(..., cheap=True)`: list schedulers, contiguous, greedy) is placed under every
order of `candidate_orders` and the smallest simulated step time wins, so the trees rank the candidates but
cannot mislead on graphs unlike the study's; for the other placers (anneal, placeto, seq2seq: one run costs
many simulations or a training) the tree's order is used, unless `try_orders=K` asks to try its top K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from devplace.defaults import CANONICAL_ORDER, RECOMMEND_PLACER
from devplace.errors import DevplaceError, FormatError
from devplace.files import json_kind, json_text, parse_json, read_limited, write_output
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, load_cluster
from devplace.hardware.features import graph_features
from devplace.orders.traversal import ORDERS

ORDER_MODEL_FORMAT = "devplace.order-model/1"
POOLED = "*"


class OrderModelError(DevplaceError):
    """An order-recommendation model that cannot be used: unknown placer key shape, bad tree, bad order."""


@dataclass(frozen=True)
class Recommendation:
    """The order chosen for a graph and why: the rule that fired, its expected gain over `topo`, and every
    candidate order ranked best first (what `--try K` walks)."""

    order: str
    rule: str
    expected_gain: float
    ranking: tuple[str, ...]
    placer: str
    source: str  # "placer" (the placer's own tree) or "default"
    graphs: int = 0  # training graphs behind the rule
    features: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN features become null."""
        return {"order": self.order, "rule": self.rule, "expected_gain": self.expected_gain,
                "ranking": list(self.ranking), "placer": self.placer, "source": self.source,
                "graphs": self.graphs,
                "features": {k: None if math.isnan(v) else v for k, v in self.features.items()}}


def _check_node(node: Any, where: str) -> None:
    if not isinstance(node, dict):
        raise OrderModelError(f"{where}: a tree node must be an object, got {type(node).__name__}")
    if "order" in node:
        if node["order"] not in ORDERS:
            raise OrderModelError(f"{where}: unknown order {node['order']!r}; valid orders: {', '.join(ORDERS)}")
        ranking = node.get("ranking", [node["order"]])
        if not isinstance(ranking, list) or any(o not in ORDERS for o in ranking) or node["order"] not in ranking:
            raise OrderModelError(f"{where}: 'ranking' must list valid orders including {node['order']!r}")
        return
    if not isinstance(node.get("feature"), str) or not isinstance(node.get("threshold"), int | float):
        raise OrderModelError(f"{where}: a split needs a 'feature' name and a numeric 'threshold'")
    _check_node(node.get("le"), f"{where}.le")
    _check_node(node.get("gt"), f"{where}.gt")


def _fmt(x: float) -> str:
    return f"{x:.4g}"


class OrderModel:
    """A loaded order-recommendation model; `recommend(features, placer)` evaluates it."""

    def __init__(self, doc: dict[str, Any], source: str = "<dict>") -> None:
        if not isinstance(doc, dict) or doc.get("format") != ORDER_MODEL_FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise FormatError(f"{source}: not an order model of format {ORDER_MODEL_FORMAT!r} (got {got!r}); fit "
                              f"one with `devplace study report DB -o DIR` (writes DIR/order_model.json) or use "
                              f"the shipped model")
        placers = doc.get("placers")
        if not isinstance(placers, dict):
            raise OrderModelError(f"{source}: 'placers' must map placer names to trees")
        for name, entry in placers.items():
            if not isinstance(entry, dict):
                raise OrderModelError(f"{source}: placers.{name} must be an object with a 'tree'")
            _check_node(entry.get("tree"), f"{source}: placers.{name}.tree")
        self.doc = doc
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> OrderModel:
        """Read a model file; FormatError for bad JSON or another format/version."""
        p = Path(path)
        try:
            text = read_limited(p).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{p} is not UTF-8 text; an order model is a JSON file") from None
        doc = parse_json(text, str(p), "an order model is a devplace.order-model/1 JSON file")
        return cls(doc, str(p))

    def save(self, path: str | Path) -> None:
        """Write the model as indented JSON with sorted-free, stable key order (as built)."""
        write_output(path, json_text(self.doc, indent=1) + "\n", "order model", json_kind("devplace.order-model"))

    @property
    def placers(self) -> list[str]:
        """Placer names with their own tree (without the pooled "*")."""
        return sorted(k for k in self.doc["placers"] if k != POOLED)

    @property
    def cluster(self) -> str | None:
        """The cluster the model was fitted on (used for features when the caller gives none)."""
        return self.doc.get("cluster")

    def rules(self, placer: str) -> list[str]:
        """Every leaf of `placer`'s tree as one rule "cond and cond -> order"."""
        out: list[str] = []

        def walk(node: dict[str, Any], bounds: dict[str, list[float]]) -> None:
            if "order" in node:
                # one interval per feature: "a < f <= b" rather than "f > a and f <= b"
                conds = []
                for f, (lo, hi) in bounds.items():
                    if lo > -math.inf and hi < math.inf:
                        conds.append(f"{_fmt(lo)} < {f} <= {_fmt(hi)}")
                    else:
                        conds.append(f"{f} <= {_fmt(hi)}" if hi < math.inf else f"{f} > {_fmt(lo)}")
                lhs = " and ".join(conds) if conds else "always"
                out.append(f"{lhs} -> {node['order']} (gain over topo {node.get('gain', 0.0):+.2%}, "
                           f"{node.get('graphs', 0)} graphs)")
                return
            f, t = node["feature"], float(node["threshold"])
            lo, hi = bounds.get(f, [-math.inf, math.inf])
            walk(node["le"], {**bounds, f: [lo, min(hi, t)]})
            walk(node["gt"], {**bounds, f: [max(lo, t), hi]})

        walk(self.doc["placers"][placer]["tree"], {})
        return out

    def recommend(self, features: dict[str, float], placer: str, *, uses_order: bool = True) -> Recommendation:
        """The order for a graph with these `features` under `placer` (see the module docstring's fallbacks)."""
        placers = self.doc["placers"]
        if not uses_order:
            return Recommendation(CANONICAL_ORDER, f"placer {placer!r} does not walk the graph in an order", 0.0,
                                  (CANONICAL_ORDER,), placer, "default", 0, dict(features))
        if placer not in placers:
            # The study never ran this placer: its order effect is unmeasured, so keep the canonical order rather
            # than extrapolate the pooled tree (which on Inception-v3 sent m-etf to lexicographic: 80 ms against
            # topo's 61 ms). --try K walks topo first, then the pooled tree's ranking (or DESIGN.md's table).
            pooled = self._leaf(placers[POOLED]["tree"], features)[0].get("ranking", []) if POOLED in placers else []
            rest = [o for o in (*pooled, *ORDERS) if o not in (CANONICAL_ORDER, "random")]
            ranking = (CANONICAL_ORDER, *dict.fromkeys(rest))
            return Recommendation(CANONICAL_ORDER, f"no rule for placer {placer!r} in the model (the study did not run "
                                  f"it): default order {CANONICAL_ORDER}", 0.0, ranking, placer, "default", 0,
                                  dict(features))
        node, conds = self._leaf(placers[placer]["tree"], features)
        rule = (" and ".join(conds) if conds else "always") + f" -> {node['order']}"
        ranking = tuple(node.get("ranking", [node["order"]]))
        return Recommendation(node["order"], rule, float(node.get("gain", 0.0)), ranking, placer, "placer",
                              int(node.get("graphs", 0)), dict(features))

    @staticmethod
    def _leaf(node: dict[str, Any], features: dict[str, float]) -> tuple[dict[str, Any], list[str]]:
        """The leaf of a tree that `features` reach, and the conditions met on the way."""
        conds: list[str] = []
        while "order" not in node:
            f = node["feature"]
            if f not in features:
                raise OrderModelError(f"the order model tests feature {f!r}, which devplace does not compute; "
                                      f"refit the model with this devplace version")
            x, t = float(features[f]), float(node["threshold"])
            if math.isnan(x) or x <= t:
                conds.append(f"{f} = {_fmt(x)} <= {_fmt(t)}")
                node = node["le"]
            else:
                conds.append(f"{f} = {_fmt(x)} > {_fmt(t)}")
                node = node["gt"]
        return node, conds


def candidate_orders(rec: Recommendation) -> list[str]:
    """Every order that `order="auto"` tries for a cheap placer: the recommendation's ranking first (so that a
    tie keeps the model's higher-ranked order), then the other orders in DESIGN.md's table order. `random` is
    left out: its placement depends on the seed, not on the graph's structure."""
    return list(dict.fromkeys(o for o in (*rec.ranking, *ORDERS) if o != "random"))


SHIPPED_MODEL = "order_model.json"


@lru_cache(maxsize=1)
def shipped_model() -> OrderModel:
    """The model shipped in the package (`devplace/data/order_model.json`), loaded once."""
    path = resources.files("devplace") / "data" / SHIPPED_MODEL
    return OrderModel.load(Path(str(path)))


def load_order_model(path: str | Path | None = None) -> OrderModel:
    """The model at `path`, or the shipped one when `path` is None."""
    return shipped_model() if path is None else OrderModel.load(path)


def recommend_order(graph: CompGraph, cluster: Cluster | None = None, *, placer: str = RECOMMEND_PLACER,
                    model: OrderModel | None = None, uses_order: bool = True) -> Recommendation:
    """Recommend a traversal order for `graph` under `placer`: the features of `graph` on `cluster` (the
    model's own cluster when None) go through the placer's tree. Deterministic."""
    m = model or shipped_model()
    if cluster is None and m.cluster:
        cluster = load_cluster(m.cluster)
    return m.recommend(graph_features(graph, cluster), placer, uses_order=uses_order)
