"""The study's statistics, as plain functions over the rows of a results database (`store.read_cells`).

Vocabulary:
- a **cell** is one row: one graph x cluster x simulation model x placer x settings x order x seed;
- a **unit** is a graph x cluster x simulation model x placer x settings: the block in which orders compete;
- a cell is **usable** when its status is "ok", it is feasible and it has a step time. Failed and infeasible
  cells are counted (`cell_counts`) and reported, never silently dropped: an order without any usable seed
  in a unit has no mean there, and the unit then leaves the statistics that need every order (Friedman,
  the recommendation tree); those units are counted as `incomplete`.

Relative step time of order o in unit u: mean over seeds of step_time(u, o) / min over orders of that mean
(1 for the unit's best order). Placers that ignore the order (order_name "-") or ran under one order only have
no order effect and are left out of the order statistics (still counted, and compared in `placer_comparison`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations, permutations
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
    # the placer as the report's statistics name it (`build_units`): its name, with its settings when the study ran
    # it under more than one (placeto's two hyperparameter sets are two learners, never pooled in one test)
    label: str = ""

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
    """Group rows into units, sorted by key. Placers that ignore the order, or were run under one order only,
    are skipped: they have no order effect."""
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
    # a placer run under one order only (say, a baseline at the default order) has no order effect to measure
    walked: dict[str, set[str]] = defaultdict(set)
    settings: dict[str, set[str]] = defaultdict(set)
    for u in units.values():
        walked[u.placer].update(u.times)
        settings[u.placer].add(u.settings)
    for u in units.values():
        u.label = u.placer if len(settings[u.placer]) == 1 else f"{u.placer} {u.settings}"
    return [units[k] for k in sorted(units) if len(walked[units[k].placer]) > 1]


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
        groups[(u.family, u.label or u.placer)].append(u)
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
    """Units grouped by placer name (sorted), every setting of a placer together (the order model's grouping)."""
    out: dict[str, list[Unit]] = defaultdict(list)
    for u in units:
        out[u.placer].append(u)
    return dict(sorted(out.items()))


def units_by_label(units: Sequence[Unit]) -> dict[str, list[Unit]]:
    """Units grouped by `Unit.label` (sorted): by placer, and by setting where a placer ran under several, which is
    how the report's statistics group them (a test over two learners' units would count a graph twice)."""
    out: dict[str, list[Unit]] = defaultdict(list)
    for u in units:
        out[u.label or u.placer].append(u)
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- the paper's question
# Permutation tests enumerate every arrangement when that costs at most this many statistic evaluations, and
# otherwise draw this many seeded random arrangements (p = (hits + 1) / (draws + 1), never 0).
EXACT_LIMIT = 2_000_000
PERMUTATIONS = 20_000
BOOTSTRAP = 2_000


def block_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks within each row (block) of a blocks x treatments array: 1 = smallest, ties averaged."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:  # no complete block (a placer whose cells all failed): no ranks, not an error
        return np.zeros(values.shape, dtype=np.float64)
    return np.vstack([stats.rankdata(row) for row in values])


def _at_least(x: np.ndarray, observed: float) -> np.ndarray:
    """x >= observed up to rounding (sums of squared midranks are computed in different orders)."""
    return x >= observed - 1e-9 * max(1.0, abs(observed))


def friedman_permutation(values: np.ndarray, *, seed: int = 0, limit: int = EXACT_LIMIT,
                         draws: int = PERMUTATIONS) -> tuple[float, str]:
    """(p, method) of Friedman's test by permutation: under the null hypothesis every block's ranks are
    equally likely in any arrangement over the treatments, and the statistic (equivalently sum_j R_j^2, R_j
    the treatment rank sums; ties keep their midranks) is compared with its distribution over all
    (k!)^N arrangements. Exact (method "exact") by dynamic programming over the *sorted* rank-sum vector,
    which carries the statistic's whole distribution because every block is permuted uniformly; when that
    would exceed `limit` evaluations, `draws` seeded random arrangements (method "monte carlo")."""
    ranks = block_ranks(values)
    n, k = ranks.shape
    if n < 2 or k < 2:
        return math.nan, "none"
    observed = float((ranks.sum(axis=0) ** 2).sum())
    if math.factorial(k) <= limit:
        perms = np.array(list(permutations(range(k))), dtype=np.int64)
        states, weights = np.sort(ranks[:1], axis=1), np.ones(1)
        for b in ranks[1:-1]:
            if len(states) * len(perms) > limit:
                break
            sums = np.sort((states[:, None, :] + b[perms][None, :, :]).reshape(-1, k), axis=1)
            # midranks are multiples of 1/2, so twice the rank sums are exact integers to merge states on
            states, inverse = np.unique(np.round(sums * 2).astype(np.int64), axis=0, return_inverse=True)
            weights = np.bincount(inverse.ravel(), weights=np.repeat(weights / len(perms), len(perms)))
            states = states / 2.0
        else:
            if len(states) * len(perms) <= limit:  # the last block: only the statistic is needed
                last = ((states[:, None, :] + ranks[-1][perms][None, :, :]) ** 2).sum(axis=2)
                return float((weights[:, None] / len(perms) * _at_least(last, observed)).sum()), "exact"
    rng = np.random.Generator(np.random.PCG64(seed))
    hits = 0
    for start in range(0, draws, 1024):  # in chunks: a large study's draws x blocks x treatments is too big
        shuffled = rng.permuted(np.broadcast_to(ranks, (min(1024, draws - start), n, k)), axis=2)
        hits += int(_at_least((shuffled.sum(axis=1) ** 2).sum(axis=1), observed).sum())
    return (hits + 1) / (draws + 1), "monte carlo"


def _label_arrangements(labels: Sequence[int]) -> Iterable[np.ndarray]:
    """Every distinct assignment of the multiset `labels` (group indices 0..G-1) to positions (multinomial
    many), each as an array of group indices."""
    sizes = np.bincount(np.asarray(labels))
    n = len(labels)

    def fill(free: tuple[int, ...], group: int, out: np.ndarray) -> Iterable[np.ndarray]:
        if group == len(sizes) - 1:
            out[list(free)] = group
            yield out.copy()
            return
        for chosen in combinations(free, int(sizes[group])):
            out[list(chosen)] = group
            yield from fill(tuple(x for x in free if x not in chosen), group + 1, out)

    yield from fill(tuple(range(n)), 0, np.zeros(n, dtype=np.int64))


def interaction_test(ranks: np.ndarray, groups: Sequence[str], *, seed: int = 0, limit: int = 200_000,
                     draws: int = PERMUTATIONS) -> dict[str, Any]:
    """Group x treatment interaction on within-block ranks (blocks x treatments, e.g. graphs x orders): does
    the treatments' ranking depend on the block's group (the family)? Statistic T = sum_f n_f ||mean rank
    vector of group f - overall mean rank vector||^2, the between-group spread of the ranking; under the null
    hypothesis (the same ranking distribution in every group) the blocks' rank vectors are exchangeable
    between groups, so p is the share of group relabellings (group sizes kept) with T at least the observed.
    Every relabelling when there are at most `limit` (method "exact"), else `draws` seeded random ones
    ("monte carlo", p = (hits + 1) / (draws + 1)). Ranks remove each block's own level and scale, so the test
    needs no model of step times."""
    ranks = np.asarray(ranks, dtype=np.float64)
    names = sorted(set(groups))
    res: dict[str, Any] = {"statistic": math.nan, "p": math.nan, "method": "none", "arrangements": 0,
                           "groups": len(names), "blocks": len(groups)}
    if len(names) < 2 or ranks.ndim != 2 or ranks.shape[1] < 2:
        return res
    index = np.array([names.index(g) for g in groups])
    sizes = np.bincount(index).astype(np.float64)
    centred = ranks - ranks.mean(axis=0)

    def stat(idx: np.ndarray) -> np.ndarray:  # idx: arrangements x blocks of group indices
        onehot = (idx[:, None, :] == np.arange(len(names))[None, :, None]).astype(np.float64)
        sums = onehot @ centred  # arrangements x groups x treatments
        return ((sums ** 2).sum(axis=2) / sizes).sum(axis=1)

    observed = float(stat(index[None, :])[0])
    total = math.factorial(len(groups))
    for s in sizes:
        total //= math.factorial(int(s))
    if total <= limit:
        arrangements = list(_label_arrangements(index.tolist()))
        hits = sum(int(_at_least(stat(np.array(arrangements[i:i + 4096])), observed).sum())
                   for i in range(0, len(arrangements), 4096))
        p, method, count = hits / total, "exact", total
    else:
        rng = np.random.Generator(np.random.PCG64(seed))
        shuffled = rng.permuted(np.tile(index, (draws, 1)), axis=1)
        hits = sum(int(_at_least(stat(shuffled[i:i + 4096]), observed).sum()) for i in range(0, draws, 4096))
        p, method, count = (hits + 1) / (draws + 1), "monte carlo", draws
    res.update(statistic=observed, p=p, method=method, arrangements=count)
    return res


def replicate_table(units: Sequence[Unit], orders: Sequence[str]) -> tuple[np.ndarray, int]:
    """graphs x orders x replicates array of step times from the units that have the same number r >= 1 of
    usable seeds for every order (r = the most common count; the others are dropped and counted)."""
    counts = [min(len(u.times.get(o, [])) for o in orders) if orders else 0 for u in units]
    full = [(u, c) for u, c in zip(units, counts, strict=True)
            if c and all(len(u.times.get(o, [])) == c for o in orders)]
    if not full:
        return np.zeros((0, len(orders), 0)), len(units)
    values, freq = np.unique([c for _, c in full], return_counts=True)
    r = int(values[np.argmax(freq)])
    keep = [u for u, c in full if c == r]
    return np.array([[u.times[o] for o in orders] for u in keep], dtype=np.float64), len(units) - len(keep)


def mixed_anova(y: np.ndarray) -> dict[str, Any]:
    """Order effect with graph as a random factor: the balanced two-way mixed-model ANOVA of log step time
    (graphs x orders x replicates `y`; orders fixed, graphs random, seeds the replicates). The order effect
    is tested against the order x graph interaction, F = MS_order / MS_order:graph on ((k-1), (k-1)(g-1))
    degrees of freedom, so the graphs studied count as a sample of the family, not as the whole of it; seeds
    estimate the run-to-run noise (MS_error). Returns F, p, the degrees of freedom and the standard deviations
    (log units, ~ relative) of the order effect, the order x graph interaction and the seed-to-seed noise,
    from the expected mean squares (a negative variance estimate is reported as 0)."""
    g, k, r = y.shape
    res: dict[str, Any] = {"graphs": g, "orders": k, "replicates": r, "F": math.nan, "p": math.nan,
                           "df": (k - 1, (k - 1) * (g - 1)), "sd_order": math.nan, "sd_order_graph": math.nan,
                           "sd_noise": math.nan}
    if g < 2 or k < 2 or r < 1:
        return res
    x = np.log(y)
    grand, by_graph, by_order, cell = x.mean(), x.mean(axis=(1, 2)), x.mean(axis=(0, 2)), x.mean(axis=2)
    ms_order = g * r * float(((by_order - grand) ** 2).sum()) / (k - 1)
    ms_inter = r * float(((cell - by_graph[:, None] - by_order[None, :] + grand) ** 2).sum()) / ((k - 1) * (g - 1))
    ms_error = float(((x - cell[..., None]) ** 2).sum()) / (g * k * (r - 1)) if r > 1 else math.nan
    if ms_inter > 0:
        res["F"] = ms_order / ms_inter
        res["p"] = float(stats.f.sf(res["F"], k - 1, (k - 1) * (g - 1)))
    res["sd_order"] = math.sqrt(max(0.0, (ms_order - ms_inter) / (g * r)))
    if r > 1:
        res["sd_noise"] = math.sqrt(ms_error)
        res["sd_order_graph"] = math.sqrt(max(0.0, (ms_inter - ms_error) / r))
    return res


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (NaN stays NaN and does not count): the i-th
    smallest of m is multiplied by m - i + 1, made non-decreasing, capped at 1. Reject where adjusted <= alpha
    (controls the family-wise error rate at alpha)."""
    ps = [float(p) for p in pvalues]
    valid = sorted((p, i) for i, p in enumerate(ps) if not math.isnan(p))
    out = [math.nan] * len(ps)
    running = 0.0
    for rank, (p, i) in enumerate(valid):
        running = max(running, min(1.0, (len(valid) - rank) * p))
        out[i] = running
    return out


def spread_and_noise(y: np.ndarray) -> tuple[float, float, float]:
    """(spread, noise, range) of a graphs x orders x replicates table: spread = worst / best - 1 of the
    orders' mean relative step time (each run / its graph's best order mean, as `family_summary`); noise =
    the pooled seed-to-seed standard deviation of log step time (~ relative; NaN with one replicate); range =
    the largest max / min - 1 over the seeds of one graph and order."""
    means = y.mean(axis=2)
    rel = (y / means.min(axis=1)[:, None, None]).mean(axis=(0, 2))
    spread = float(rel.max() / rel.min() - 1)
    g, k, r = y.shape
    if r < 2:
        return spread, math.nan, math.nan
    x = np.log(y)
    noise = math.sqrt(float(((x - x.mean(axis=2, keepdims=True)) ** 2).sum()) / (g * k * (r - 1)))
    return spread, noise, float((y.max(axis=2) / y.min(axis=2)).max() - 1)


def noise_interval(y: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(noise, low, high): the pooled seed-to-seed standard deviation of log step time (`spread_and_noise`) with
    its chi-square interval on g k (r - 1) degrees of freedom (normal errors); NaNs with one replicate."""
    g, k, r = y.shape
    noise = spread_and_noise(y)[1]
    if math.isnan(noise):
        return noise, math.nan, math.nan
    df = g * k * (r - 1)
    tail = (1 - level) / 2
    return (noise, noise * math.sqrt(df / stats.chi2.ppf(1 - tail, df)),
            noise * math.sqrt(df / stats.chi2.ppf(tail, df)))


def bootstrap_spread(y: np.ndarray, *, seed: int = 0, draws: int = BOOTSTRAP,
                     level: float = 0.95) -> tuple[float, float, float]:
    """(spread, low, high): the spread between the best and worst order of a graphs x orders x replicates table
    (`spread_and_noise`) with a seeded percentile bootstrap interval that resamples graphs with replacement
    (each keeps its seeds, so the interval carries both which graphs were studied and their run-to-run noise).
    The spread is a max - min of noisy means, biased upward when the orders do not differ: read it beside the
    noise and the tests."""
    lo, hi = bootstrap_graphs(y.shape[0], lambda idx: spread_and_noise(y[idx])[0], seed=seed, draws=draws,
                              level=level)
    return spread_and_noise(y)[0], lo, hi


def bootstrap_graphs(graphs: int, statistic: Callable[[np.ndarray], float], *, seed: int, draws: int,
                     level: float) -> tuple[float, float]:
    """(low, high): the seeded percentile bootstrap interval at `level` of `statistic` over `graphs` graphs,
    resampled with replacement, each keeping its rows (its seeds, its pairs): `statistic(idx)` is the statistic
    on the graphs `idx` (int64[graphs], repeats included) of each of the `draws` resamples. NaNs below 2 graphs."""
    if graphs < 2:
        return math.nan, math.nan
    rng = np.random.Generator(np.random.PCG64(seed))
    samples = [statistic(rng.integers(0, graphs, size=graphs)) for _ in range(draws)]
    tail = (100 - 100 * level) / 2  # 2.5 for 0.95 exactly ((1 - level) / 2 * 100 is 2.500000000000002)
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return float(lo), float(hi)


def placer_comparison(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each learned placer (its rows record training episodes) against every other placer, per graph (same
    cluster, simulation model and semantics). A placer's result on a graph is its best order's mean step time
    over usable seeds (placers that ignore the order have one "order", "-"); the learned placer's mean over
    all its orders is given too. One entry per learned placer (and settings) and graph: `time`, `order`,
    `mean_time` (over orders), `others` {placer: (time, order)} and `best_other` (the fastest of the others,
    every classic placer and one device when the study ran them)."""
    runs: dict[tuple[tuple[str, str, str, str], str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    learned: set[str] = set()
    family: dict[str, str] = {}
    for r in rows:
        where = _where(r)
        name = _learned_name(r) or str(r["placer"])
        if r.get("episodes") is not None:
            learned.add(name)
        family[where[0]] = str(r.get("family"))
        times = runs[(where, name)][str(r.get("order_name"))]
        if usable(r):
            times.append(float(r["step_time_s"]))
    best: dict[tuple[str, str, str, str], dict[str, tuple[float, str, float]]] = defaultdict(dict)
    for (where, name), by_order in runs.items():
        means = {o: float(np.mean(t)) for o, t in by_order.items() if t}
        if means:
            o = min(means, key=lambda x: (means[x], order_sort_key(x)))
            best[where][name] = (means[o], o, float(np.mean(list(means.values()))))
    out = []
    for where, entries in sorted(best.items()):
        for name in sorted(learned & set(entries)):
            others = {p: (t, o) for p, (t, o, _) in sorted(entries.items()) if p not in learned}
            if not others:
                continue
            fastest = min(others, key=lambda p: (others[p][0], p))
            t, o, mean_time = entries[name]
            out.append({"graph": where[0], "family": family[where[0]], "cluster": where[1], "sim_model": where[2],
                        "semantics": where[3], "placer": name, "time": t, "order": o, "mean_time": mean_time,
                        "others": others, "best_other": fastest})
    return out


ONE_DEVICE = "single"  # the placer that is one device (DESIGN.md section 7)


def runs_at_one_device(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, tuple[int, int]]]:
    """How often a learned placer's answer is one device's step (`single`'s on the same graph, cluster, simulation
    model and semantics, to 1e-9 relative): a run from all on one device that found nothing faster in its
    episodes. {(learned placer with settings, family): {order: (runs at one device, usable runs)}}; graphs the
    study ran no `single` cell on are left out."""
    single: dict[tuple[str, str, str, str], float] = {}
    for r in rows:
        if r["placer"] == ONE_DEVICE and usable(r):
            single[_where(r)] = float(r["step_time_s"])
    counts: dict[tuple[str, str], dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in rows:
        if r.get("episodes") is None or not usable(r) or _where(r) not in single:
            continue
        one = single[_where(r)]
        c = counts[(str(_learned_name(r)), str(r.get("family")))][str(r.get("order_name"))]
        c[0] += abs(float(r["step_time_s"]) - one) <= 1e-9 * one
        c[1] += 1
    return {k: {o: (a, n) for o, (a, n) in sorted(v.items(), key=lambda x: order_sort_key(x[0]))}
            for k, v in sorted(counts.items())}


def _where(r: dict[str, Any]) -> tuple[str, str, str, str]:
    """Where a row ran: graph, cluster, simulation model, semantics."""
    return (str(r["graph"]), str(r["cluster"]), str(r["sim_model"]), str(r.get("semantics") or ""))


def _learned_name(r: dict[str, Any]) -> str | None:
    """A learned placer's row (one that records episodes) named as the comparisons name it: the placer, with its
    settings unless they are empty; None for any other row."""
    if r.get("episodes") is None:
        return None
    settings = _settings_key(r.get("settings"))
    return str(r["placer"]) + ("" if settings in ("{}", "null") else f" {settings}")


def settings_comparison(rows: Sequence[dict[str, Any]], *, seed: int = 0, draws: int = BOOTSTRAP,
                        level: float = 0.95) -> list[dict[str, Any]]:
    """One placer under two settings (e.g. placeto under `placeto-paper` and under devplace's own set) on the
    cells they share: the same graph, cluster, simulation model, semantics, order and seed. Per placer, pair of
    settings (`a` the first in sorted order, `b` the other) and family: `pairs`, `graphs`, the geometric mean of
    b's step over a's (`ratio`, below 1: b faster) with a seeded percentile bootstrap interval at `level` that
    resamples graphs (each keeps its pairs, `bootstrap_graphs`), `b_faster` (the share of pairs where b is
    faster) and `p`, the two-sided Wilcoxon signed-rank p of the log ratios (nan below 2 pairs or when every
    ratio is 1)."""
    times: dict[tuple[str, str], dict[tuple[Any, ...], float]] = defaultdict(dict)
    family: dict[str, str] = {}
    for r in rows:
        if not usable(r):
            continue
        key = (*_where(r), str(r.get("order_name")), r.get("seed"))
        times[(str(r["placer"]), _settings_key(r.get("settings")))][key] = float(r["step_time_s"])
        family[str(r["graph"])] = str(r.get("family"))
    out = []
    placers = sorted({p for p, _ in times})
    for placer in placers:
        for a, b in combinations(sorted(s for p, s in times if p == placer), 2):
            ta, tb = times[(placer, a)], times[(placer, b)]
            shared = sorted(set(ta) & set(tb), key=str)
            for fam in sorted({family[k[0]] for k in shared}):
                keys = [k for k in shared if family[k[0]] == fam]
                logs = np.log([tb[k] / ta[k] for k in keys])
                graphs = sorted({k[0] for k in keys})
                per_graph = [logs[[k[0] == g for k in keys]] for g in graphs]
                lo, hi = (float(np.exp(x)) for x in bootstrap_graphs(
                    len(graphs), lambda idx, per_graph=per_graph: np.concatenate([per_graph[i] for i in idx]).mean(),
                    seed=seed, draws=draws, level=level))
                p = (float(stats.wilcoxon(logs).pvalue) if len(logs) >= 2 and np.any(logs != 0) else math.nan)
                out.append({"placer": placer, "a": a, "b": b, "family": fam, "pairs": len(keys),
                            "graphs": len(graphs), "ratio": float(np.exp(logs.mean())), "low": lo, "high": hi,
                            "b_faster": float(np.mean(logs < 0)), "p": p})
    return out
