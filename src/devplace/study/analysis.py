"""The study's statistics, as plain functions over the rows of a results database (`store.read_cells`).

Vocabulary:
- a **cell** is one row: one graph x cluster x simulation model x placer x settings x order x seed;
- a **unit** is a graph x cluster x simulation model x placer x settings: the block in which orders compete;
- a cell is **usable** when its status is "ok", it is feasible and it has a step time. Failed and infeasible
  cells are counted (`cell_counts`) and reported, never silently dropped: an order without any usable seed
  in a unit has no mean there, and the unit then leaves the statistics that need every order (Friedman,
  the recommendation tree); those units are counted as `incomplete`.

Relative step time of order o in unit u: mean over seeds of step_time(u, o) / min over orders of that mean
(1 for the unit's best order). Placers that ignore the order (order_name "-") have no order effect and are
left out of the order statistics (still counted).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from devplace.orders import ORDERS

NO_ORDER = "-"

# Critical values q_alpha of the Nemenyi test for alpha = 0.05, k = 2..10 compared classifiers/treatments:
# the Studentized range statistic divided by sqrt(2), as tabulated by J. Demšar, "Statistical Comparisons of
# Classifiers over Multiple Data Sets", JMLR 7 (2006), Table 5(a). Larger k are computed from scipy's
# studentized_range distribution (the same definition, infinite degrees of freedom approximated by 1e6).
NEMENYI_Q05: dict[int, float] = {2: 1.960, 3: 2.343, 4: 2.569, 5: 2.728, 6: 2.850, 7: 2.949, 8: 3.031,
                                 9: 3.102, 10: 3.164}


def nemenyi_q(k: int, alpha: float = 0.05) -> float:
    """q_alpha of the Nemenyi test for k treatments (table for alpha = 0.05 and k <= 10, else scipy)."""
    if k < 2:
        raise ValueError("the Nemenyi test needs at least 2 treatments")
    if alpha == 0.05 and k in NEMENYI_Q05:
        return NEMENYI_Q05[k]
    return float(stats.studentized_range.ppf(1 - alpha, k, 1e6) / math.sqrt(2))


def load_rows(db_path: str | Path) -> list[dict[str, Any]]:
    """Every row of the results database, JSON columns decoded (the store's `read_cells`)."""
    from devplace.study.store import read_cells

    return read_cells(db_path)


def usable(row: dict[str, Any]) -> bool:
    """A finished, feasible cell with a step time."""
    return row.get("status") == "ok" and bool(row.get("feasible")) and row.get("step_time_s") is not None


def _settings_key(settings: Any) -> str:
    if isinstance(settings, str):
        return settings
    return json.dumps(settings or {}, sort_keys=True)


def unit_key(row: dict[str, Any]) -> tuple[str, str, str, str, str, str]:
    """(graph, cluster, sim_model, placer, settings JSON, semantics): the block in which orders compete. Cells of
    one graph placed op by op and as autograd runs are different experiments (rows before the semantics column:
    "")."""
    return (str(row["graph"]), str(row["cluster"]), str(row["sim_model"]), str(row["placer"]),
            _settings_key(row.get("settings")), str(row.get("semantics") or ""))


def order_sort_key(order: str) -> tuple[int, str]:
    """Orders in DESIGN.md's table order (topo first), unknown names after them alphabetically."""
    return (ORDERS.index(order), order) if order in ORDERS else (len(ORDERS), order)


def cell_counts(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals of cells: ok (usable), failed, infeasible (ok but over memory), and the failed/infeasible ones
    per placer and per family, with the most common error messages."""
    total = len(rows)
    failed = [r for r in rows if r.get("status") != "ok"]
    infeasible = [r for r in rows if r.get("status") == "ok" and not usable(r)]
    errors: dict[str, int] = defaultdict(int)
    for r in failed:
        errors[str(r.get("error") or "no error recorded").split("\n")[0][:160]] += 1
    by: dict[str, dict[str, list[int]]] = {"placer": defaultdict(lambda: [0, 0, 0]),
                                          "family": defaultdict(lambda: [0, 0, 0])}
    for r in rows:
        for col in ("placer", "family"):
            entry = by[col][str(r.get(col))]
            entry[0] += 1
            entry[1] += r.get("status") != "ok"
            entry[2] += r.get("status") == "ok" and not usable(r)
    return {"cells": total, "ok": total - len(failed) - len(infeasible), "failed": len(failed),
            "infeasible": len(infeasible),
            "errors": sorted(errors.items(), key=lambda kv: (-kv[1], kv[0])),
            "by_placer": {k: dict(zip(("cells", "failed", "infeasible"), v, strict=True))
                          for k, v in sorted(by["placer"].items())},
            "by_family": {k: dict(zip(("cells", "failed", "infeasible"), v, strict=True))
                          for k, v in sorted(by["family"].items())}}


@dataclass
class Unit:
    """One block of the study: a graph under one cluster, simulation model, placer and settings, with the
    step times of every order over seeds."""

    key: tuple[str, str, str, str, str, str]
    family: str
    graph_name: str
    features: dict[str, float]
    times: dict[str, list[float]] = field(default_factory=dict)  # order -> usable step times over seeds
    missing: dict[str, int] = field(default_factory=dict)  # order -> failed or infeasible seeds

    @property
    def graph(self) -> str:
        return self.key[0]

    @property
    def cluster(self) -> str:
        return self.key[1]

    @property
    def sim_model(self) -> str:
        return self.key[2]

    @property
    def placer(self) -> str:
        return self.key[3]

    @property
    def settings(self) -> str:
        return self.key[4]

    @property
    def semantics(self) -> str:
        return self.key[5]

    def means(self) -> dict[str, float]:
        """Mean step time over usable seeds for every order that has one."""
        return {o: float(np.mean(t)) for o, t in self.times.items() if t}

    def best_time(self) -> float:
        """The smallest mean step time over orders (NaN when no order has a usable cell)."""
        m = self.means()
        return min(m.values()) if m else math.nan

    def relative(self) -> dict[str, float]:
        """Each order's mean step time / the best order's mean."""
        m = self.means()
        best = min(m.values()) if m else math.nan
        return {o: v / best for o, v in m.items()} if best > 0 else {o: 1.0 for o in m}

    def best_order(self) -> str | None:
        """The order with the smallest mean (ties: DESIGN.md's table order, so topo wins ties)."""
        m = self.means()
        return min(m, key=lambda o: (m[o], order_sort_key(o))) if m else None


def build_units(rows: Iterable[dict[str, Any]]) -> list[Unit]:
    """Group rows into units (placers that ignore the order are skipped), sorted by key."""
    units: dict[tuple[str, str, str, str, str], Unit] = {}
    for r in rows:
        order = r.get("order_name")
        if order in (None, NO_ORDER):
            continue
        k = unit_key(r)
        u = units.get(k)
        feats = r.get("features") or {}
        if isinstance(feats, str):  # rows read without decoding the JSON columns
            feats = json.loads(feats)
        if u is None:
            u = units[k] = Unit(k, str(r.get("family")), str(r.get("graph_name") or r["graph"]),
                                {f: (math.nan if v is None else float(v)) for f, v in feats.items()})
        elif not u.features and feats:  # a failed first cell may have no features
            u.features = {f: (math.nan if v is None else float(v)) for f, v in feats.items()}
        u.times.setdefault(order, [])
        if usable(r):
            u.times[order].append(float(r["step_time_s"]))
        else:
            u.missing[order] = u.missing.get(order, 0) + 1
    return [units[k] for k in sorted(units)]


def orders_of(units: Iterable[Unit]) -> list[str]:
    """Every order that appears in `units`, in DESIGN.md's table order."""
    return sorted({o for u in units for o in u.times}, key=order_sort_key)


def complete_units(units: Sequence[Unit], orders: Sequence[str]) -> tuple[list[Unit], int]:
    """The units with a usable mean for every one of `orders`, and how many were not complete."""
    done = [u for u in units if all(u.times.get(o) for o in orders)]
    return done, len(units) - len(done)


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student-t confidence interval of the mean (low = high = mean for n < 2)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if x.size < 2:
        return m, m, m
    half = float(stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return m, m - half, m + half


def family_summary(units: Sequence[Unit]) -> list[dict[str, Any]]:
    """Per family and placer: every order's mean relative step time with a 95% CI over graphs and seeds
    (each seed's step time / the unit's best mean), the number of values, the best and worst order by that
    mean (`random` left out of those two when other orders exist), and the spread (worst / best - 1)."""
    groups: dict[tuple[str, str], list[Unit]] = defaultdict(list)
    for u in units:
        groups[(u.family, u.placer)].append(u)
    out = []
    for (family, placer), us in sorted(groups.items()):
        per_order: dict[str, list[float]] = defaultdict(list)
        for u in us:
            best = u.best_time()
            if not best > 0:
                continue
            for o, ts in u.times.items():
                per_order[o].extend(t / best for t in ts)
        rows = {}
        for o in sorted(per_order, key=order_sort_key):
            m, lo, hi = mean_ci(per_order[o])
            rows[o] = {"mean": m, "low": lo, "high": hi, "n": len(per_order[o])}
        # best/worst/spread compare the deterministic walks: `random` (when there are others) is no walk one
        # would choose, and as the worst it would only measure how bad a random permutation is
        walks = [o for o in rows if rows[o]["n"] and o != "random"] or [o for o in rows if rows[o]["n"]]
        ranked = sorted(walks, key=lambda o: (rows[o]["mean"], order_sort_key(o)))
        best_o, worst_o = (ranked[0], ranked[-1]) if ranked else (None, None)
        spread = rows[worst_o]["mean"] / rows[best_o]["mean"] - 1 if ranked else math.nan
        wins: dict[str, int] = defaultdict(int)
        for u in us:
            b = u.best_order()
            if b is not None:
                wins[b] += 1
        out.append({"family": family, "placer": placer, "graphs": len({u.graph for u in us}), "units": len(us),
                    "orders": rows, "best": best_o, "worst": worst_o, "spread": spread, "wins": dict(wins)})
    return out


def friedman(units: Sequence[Unit], orders: Sequence[str] | None = None, alpha: float = 0.05) -> dict[str, Any]:
    """Friedman test of "do the orders differ" over `units` (blocks = units, treatments = orders, values = mean
    step time over seeds), the average rank of every order (1 = fastest, ties averaged) and the Nemenyi
    critical difference CD = q_alpha * sqrt(k (k + 1) / (6 N)): two orders whose average ranks differ by more
    than CD differ significantly at level alpha. Units lacking an order are dropped and counted."""
    orders = list(orders) if orders is not None else orders_of(units)
    blocks, dropped = complete_units(units, orders)
    k, n = len(orders), len(blocks)
    res: dict[str, Any] = {"orders": orders, "k": k, "n": n, "dropped": dropped, "statistic": math.nan,
                           "p": math.nan, "ranks": {}, "cd": math.nan, "alpha": alpha}
    if k < 2 or n < 1:
        return res
    values = np.array([[u.means()[o] for o in orders] for u in blocks])
    ranks = np.vstack([stats.rankdata(row) for row in values])
    res["ranks"] = {o: float(r) for o, r in zip(orders, ranks.mean(axis=0), strict=True)}
    res["cd"] = nemenyi_q(k, alpha) * math.sqrt(k * (k + 1) / (6.0 * n))
    if k >= 3 and n >= 2:
        if np.all(values == values[:, :1]):  # every order ties in every block: no evidence of a difference
            res["statistic"], res["p"] = 0.0, 1.0
        else:
            st = stats.friedmanchisquare(*values.T)
            res["statistic"], res["p"] = float(st.statistic), float(st.pvalue)
    return res


def feature_correlations(units: Sequence[Unit], features: Sequence[str] | None = None,
                         ) -> dict[str, dict[str, tuple[float, float]]]:
    """Spearman correlation (rho, p) of every graph feature with every order's relative step time across
    `units`: rho > 0 means the order falls further behind the best as the feature grows. Features constant
    over the units (or NaN) give (NaN, NaN)."""
    orders = orders_of(units)
    names = list(features) if features is not None else sorted({f for u in units for f in u.features})
    rel = [u.relative() for u in units]
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for f in names:
        out[f] = {}
        for o in orders:
            pairs = [(u.features.get(f, math.nan), r[o]) for u, r in zip(units, rel, strict=True) if o in r]
            xy = np.array([p for p in pairs if not math.isnan(p[0])], dtype=np.float64).reshape(-1, 2)
            if len(xy) < 3 or np.ptp(xy[:, 0]) == 0 or np.ptp(xy[:, 1]) == 0:
                out[f][o] = (math.nan, math.nan)
                continue
            r_ = stats.spearmanr(xy[:, 0], xy[:, 1])
            out[f][o] = (float(r_.statistic), float(r_.pvalue))
    return out


def feature_separation(units: Sequence[Unit], features: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Which features separate the winning orders: units grouped by their best order, a Kruskal-Wallis test
    of each feature's values across those groups (H, p) and each group's median. Sorted by p (most
    separating first); features that cannot be tested (one group, or all values equal) get p = NaN, last."""
    groups: dict[str, list[Unit]] = defaultdict(list)
    for u in units:
        b = u.best_order()
        if b is not None:
            groups[b].append(u)
    names = list(features) if features is not None else sorted({f for u in units for f in u.features})
    out = []
    for f in names:
        samples = {o: [u.features.get(f, math.nan) for u in us] for o, us in groups.items()}
        samples = {o: [x for x in xs if not math.isnan(x)] for o, xs in samples.items()}
        samples = {o: xs for o, xs in samples.items() if xs}
        h = p = math.nan
        alls = [x for xs in samples.values() for x in xs]
        if len(samples) >= 2 and len(set(alls)) > 1:
            kw = stats.kruskal(*samples.values())
            h, p = float(kw.statistic), float(kw.pvalue)
        out.append({"feature": f, "H": h, "p": p,
                    "medians": {o: float(np.median(xs)) for o, xs in sorted(samples.items(),
                                                                           key=lambda kv: order_sort_key(kv[0]))}})
    return sorted(out, key=lambda d: (math.isnan(d["p"]), d["p"] if not math.isnan(d["p"]) else 0.0, d["feature"]))


def units_by_placer(units: Sequence[Unit]) -> dict[str, list[Unit]]:
    """Units grouped by placer name (sorted)."""
    out: dict[str, list[Unit]] = defaultdict(list)
    for u in units:
        out[u.placer].append(u)
    return dict(sorted(out.items()))
