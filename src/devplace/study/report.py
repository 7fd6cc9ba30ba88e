"""`devplace study report`: a study's results section (report.md), its plots (PNG), the raw rows (results.csv)
and the order model fitted on it (order_model.json), from a results database.

`write_report(db, out_dir)` does it all and returns the paths written. Plots use matplotlib's Agg backend;
every figure is deterministic for the same rows.
"""

from __future__ import annotations

import csv
import json
import math
import re
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from devplace.errors import DevplaceError
from devplace.files import Kind, json_text, output_file, output_folder, save_png, write_output
from devplace.graph.features import FEATURE_NAMES
from devplace.study import analysis as an
from devplace.study.recommend import fit_order_model, make_dataset, validate


class ReportError(DevplaceError):
    """A results database a report cannot be made from (empty, or no placer that uses an order)."""


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.2%}"


def _num(x: float, fmt: str = ".3g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _p(x: float) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return "< 1e-10" if x < 1e-10 else f"{x:.2g}"


# the report's own files, recognised so that a report is rewritten in place but another file of the same name in
# the folder is replaced only with --force (`devplace.files.Kind`)
RESULTS_CSV = Kind("study results CSV", lambda head: head.startswith(b"key,study,graph,"))
FEATURES_CSV = Kind("graph features CSV", lambda head: head.startswith(b"graph,cluster"))
REPORT_MD = Kind("study report", lambda head: head.startswith(b"# Traversal-order study"))
VALIDATION_JSON = Kind("report validation JSON", lambda head: head.startswith(b"{\n") or head == b"{}\n")


def _safe(name: str) -> str:
    """`name` as a file name: each run of other characters than letters, digits, '-' and '_' becomes one '_'."""
    return re.sub(r"[^0-9A-Za-z_-]+", "_", name).strip("_")


# ----------------------------------------------------------------------------- csv
def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """All rows, one line each, in the store's column order; JSON columns as JSON text. The graph features,
    the same on every row of a graph and cluster, go once per (graph, cluster) to `features.csv` beside it
    (returned), which keeps the raw table a tenth of the size."""
    from devplace.study.store import COLUMN_NAMES, JSON_COLUMNS

    cols = [c for c in list(COLUMN_NAMES) + sorted({k for r in rows for k in r} - set(COLUMN_NAMES))
            if c != "features"]
    with output_file(path, "report", RESULTS_CSV, newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow([json_text(r.get(c), sort_keys=True) if c in JSON_COLUMNS and r.get(c) is not None
                        and not isinstance(r.get(c), str) else r.get(c) for c in cols])
    per_graph: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        feats = r.get("features")
        if isinstance(feats, str):
            feats = json.loads(feats)
        if feats:
            per_graph.setdefault((str(r.get("graph")), str(r.get("cluster"))), feats)
    names = sorted({k for f in per_graph.values() for k in f})
    features_path = path.with_name("features.csv")
    with output_file(features_path, "report", FEATURES_CSV, newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["graph", "cluster", *names])
        for (g, c), f in sorted(per_graph.items()):
            w.writerow([g, c, *(f.get(k) for k in names)])
    return features_path


# ----------------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "devplace", "font.size": 8})
    return plt


def plot_family_bars(summary: list[dict[str, Any]], family: str, path: Path) -> None:
    """Mean relative step time per order (95% CI error bars), one bar group per placer, for one family."""
    plt = _plt()
    entries = [s for s in summary if s["family"] == family]
    orders = sorted({o for s in entries for o in s["orders"]}, key=an.order_sort_key)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(orders) * max(1, len(entries)) / 2), 3.6))
    width = 0.8 / max(1, len(entries))
    x = np.arange(len(orders))
    for i, s in enumerate(entries):
        means = np.array([s["orders"].get(o, {}).get("mean", np.nan) for o in orders])
        lo = np.array([s["orders"].get(o, {}).get("low", np.nan) for o in orders])
        hi = np.array([s["orders"].get(o, {}).get("high", np.nan) for o in orders])
        ax.bar(x + (i - (len(entries) - 1) / 2) * width, means - 1, width, bottom=1,
               yerr=np.vstack([means - lo, hi - means]), capsize=2, label=s["placer"])
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(x, orders, rotation=35, ha="right")
    ax.set_ylabel("step time / best order's (mean, 95% CI)")
    ax.set_title(f"{family}: step time relative to each graph's best order")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path, "report", dpi=110)
    plt.close(fig)


def plot_cd(fr: dict[str, Any], title: str, path: Path) -> None:
    """Critical-difference diagram: average ranks on an axis, the Nemenyi CD as a bar, and thick lines
    joining orders whose ranks differ by less than CD (not significantly different)."""
    plt = _plt()
    ranks = sorted(fr["ranks"].items(), key=lambda kv: (kv[1], an.order_sort_key(kv[0])))
    k = max(2, fr["k"])
    fig, ax = plt.subplots(figsize=(7.0, 1.2 + 0.22 * len(ranks)))
    ax.set_xlim(0.5, k + 0.5)
    ax.hlines(0, 1, k, color="black", lw=0.8)
    for r in range(1, k + 1):
        ax.vlines(r, 0, 0.15, color="black", lw=0.8)
        ax.text(r, 0.3, str(r), ha="center", fontsize=7)
    cd = fr["cd"]
    vals = [r for _, r in ranks]
    cliques: list[tuple[float, float]] = []
    if not math.isnan(cd):
        # cliques: maximal runs of orders (sorted by rank) whose spread is below CD
        last_end = -1
        for i in range(len(vals)):
            j = max(jj for jj in range(i, len(vals)) if vals[jj] - vals[i] < cd)
            if j > i and j > last_end:
                cliques.append((vals[i], vals[j]))
                last_end = j
    for level, (a, b) in enumerate(cliques):
        ax.plot([a - 0.03, b + 0.03], [-0.25 - 0.18 * level] * 2, color="black", lw=2.5)
    below = 0.4 + 0.18 * len(cliques)  # labels start under the clique bars
    half = (len(ranks) + 1) // 2
    ax.set_ylim(-(half + below + 1), 2.2)
    for i, (name, r) in enumerate(ranks):
        left = i < half
        y = -(i + below) if left else -(len(ranks) - 1 - i + below)
        xt = 0.6 if left else k + 0.4
        ax.plot([r, r, xt], [0, y, y], color="tab:blue", lw=0.7, zorder=0)
        ax.text(xt, y, f"{name} ({r:.2f})", ha="right" if not left else "left", va="bottom", fontsize=7)
    if not math.isnan(cd):
        ax.plot([1, 1 + cd], [1.4, 1.4], color="red", lw=1.5)
        ax.text(1 + cd / 2, 1.6, f"CD = {cd:.2f}", ha="center", fontsize=7, color="red")
    ax.set_title(title + f"  (Friedman p = {_p(fr['p'])}, N = {fr['n']})", fontsize=8)
    ax.axis("off")
    fig.tight_layout()
    save_png(fig, path, "report", dpi=110)
    plt.close(fig)


def plot_heatmap(summary: list[dict[str, Any]], path: Path) -> None:
    """Order x family heat map of the mean relative step time, one panel per placer."""
    plt = _plt()
    placers = sorted({s["placer"] for s in summary})
    families = sorted({s["family"] for s in summary})
    orders = sorted({o for s in summary for o in s["orders"]}, key=an.order_sort_key)
    fig, axes = plt.subplots(1, len(placers), figsize=(2.2 + 1.1 * len(families) * len(placers), 0.3 * len(orders)
                                                         + 1.6), squeeze=False)
    for ax, placer in zip(axes[0], placers, strict=True):
        m = np.full((len(orders), len(families)), np.nan)
        for s in summary:
            if s["placer"] == placer:
                for o, v in s["orders"].items():
                    m[orders.index(o), families.index(s["family"])] = v["mean"]
        im = ax.imshow((m - 1) * 100, cmap="viridis_r", aspect="auto")
        top = np.nanmax(m) - 1 if np.isfinite(m).any() else 1.0
        for (i, j), v in np.ndenumerate(m):
            if not np.isnan(v):  # dark text on the light (near-best) cells
                ax.text(j, i, f"{(v - 1) * 100:.1f}", ha="center", va="center", fontsize=6,
                        color="black" if v - 1 < 0.4 * top else "white")
        ax.set_xticks(range(len(families)), families, rotation=30)
        ax.set_yticks(range(len(orders)), orders)
        ax.set_title(placer)
        fig.colorbar(im, ax=ax, label="% slower than best", shrink=0.8)
    fig.tight_layout()
    save_png(fig, path, "report", dpi=110)
    plt.close(fig)


def plot_curves(rows: Sequence[dict[str, Any]], placer: str, path: Path) -> bool:
    """Mean learning curve (step time after each episode / the curve's first value) per order, for a placer
    whose rows carry curves; False (nothing written) when none do."""
    curves: dict[str, list[list[float]]] = defaultdict(list)
    for r in rows:
        c = r.get("curve")
        if r.get("placer") == placer and isinstance(c, list) and len(c) > 1 and c[0]:
            curves[str(r.get("order_name"))].append([float(v) / float(c[0]) for v in c])
    if not curves:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    cmap = plt.get_cmap("tab20")  # 11 orders: tab10 would repeat a colour
    for i, o in enumerate(sorted(curves, key=an.order_sort_key)):
        n = min(len(c) for c in curves[o])
        ax.plot(np.arange(1, n + 1), np.mean([c[:n] for c in curves[o]], axis=0), label=o, lw=1,
                color=cmap(i % 20), ls="-" if i < 10 else "--")
    ax.set_xlabel("episode")
    ax.set_ylabel("step time / first episode's (mean)")
    ax.set_title(f"{placer}: learning curves by order")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_png(fig, path, "report", dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- markdown
def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _setting(rows: Sequence[dict[str, Any]], units: list[an.Unit]) -> list[str]:
    fams: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        fams[str(r.get("family"))].add(str(r.get("graph")))
    sizes = [int(r["num_nodes"]) for r in rows if r.get("num_nodes") is not None]
    placers = sorted({(str(r.get("placer")), an._settings_key(r.get("settings"))) for r in rows})
    seeds = sorted({int(r["seed"]) for r in rows if r.get("seed") is not None})
    episodes = sorted({int(r["episodes"]) for r in rows if r.get("episodes") is not None})
    lines = ["## Setting", "",
             f"- studies: {', '.join(sorted({str(r.get('study')) for r in rows}))}; {len(rows)} cells",
             "- graphs: " + "; ".join(f"{f} ({len(g)})" for f, g in sorted(fams.items()))
             + (f"; {min(sizes)}" + (f"-{max(sizes)}" if max(sizes) > min(sizes) else "")
                + " nodes after coarsening" if sizes else ""),
             f"- clusters: {', '.join(sorted({str(r.get('cluster')) for r in rows}))}; simulation model: "
             f"{', '.join(sorted({str(r.get('sim_model')) for r in rows}))}; placement semantics: "
             f"{', '.join(sorted({str(r.get('semantics') or 'not recorded') for r in rows}))}",
             "- placers: " + ", ".join(p + ("" if s in ("{}", "null") else f" {s}") for p, s in placers),
             f"- orders: {', '.join(an.orders_of(units))}",
             f"- seeds: {len(seeds)} ({', '.join(map(str, seeds[:10]))}{', ...' if len(seeds) > 10 else ''})"
             + (f"; RL episodes: {', '.join(map(str, episodes))}" if episodes else ""),
             "",
             "Relative step time = an order's mean step time over seeds / the best order's mean on the same graph, "
             "cluster, simulation model, placer and settings (1.00 = best). Means and 95% confidence intervals "
             "(Student t) are over graphs and seeds.", ""]
    return lines


def _counts(counts: dict[str, Any]) -> list[str]:
    lines = ["## Cells", "",
             f"{counts['cells']} cells: {counts['ok']} usable, {counts['failed']} failed, {counts['infeasible']} "
             "infeasible (placed but over memory). Failed and infeasible cells are not in the means below; a graph "
             "with an order lacking any usable seed leaves the rank tests and the recommendation tree "
             "(counted there as *dropped*).", ""]
    lines += _table(["placer", "cells", "failed", "infeasible"],
                    [[p, str(v["cells"]), str(v["failed"]), str(v["infeasible"])]
                     for p, v in counts["by_placer"].items()])
    lines += [""]
    lines += _table(["family", "cells", "failed", "infeasible"],
                    [[f, str(v["cells"]), str(v["failed"]), str(v["infeasible"])]
                     for f, v in counts["by_family"].items()])
    if counts["errors"]:
        lines += ["", "Most common errors:", ""]
        lines += [f"- {n} x `{msg}`" for msg, n in counts["errors"][:8]]
    return [*lines, ""]


def _family_tables(summary: list[dict[str, Any]], families: list[str]) -> list[str]:
    lines = ["## Per-family results", ""]
    for placer in sorted({s["placer"] for s in summary}):
        entries = [s for s in summary if s["placer"] == placer]
        orders = sorted({o for s in entries for o in s["orders"]}, key=an.order_sort_key)
        lines += [f"### {placer}", ""]
        body = []
        for o in orders:
            cells = []
            for s in entries:
                v = s["orders"].get(o)
                cells.append("n/a" if v is None else f"{v['mean']:.3f} [{v['low']:.3f}, {v['high']:.3f}]"
                             + (" **best**" if s["best"] == o else ""))
            body.append([o, *cells])
        lines += _table(["order", *(s["family"] for s in entries)], body)
        lines += ["", *_table(["family", "graphs", "best", "worst", "spread (worst/best - 1)", "wins per order"],
                              [[s["family"], str(s["graphs"]), str(s["best"]), str(s["worst"]), _pct(s["spread"]),
                                ", ".join(f"{o} {n}" for o, n in sorted(s["wins"].items(),
                                                                        key=lambda kv: (-kv[1], kv[0])))]
                               for s in entries]), ""]
    lines += [f"![{f}](bars_{_safe(f)}.png)" for f in families]
    lines += ["", "![order x family](heatmap.png)", ""]
    return lines


def _friedman_section(units: list[an.Unit], cd_files: dict[str, str]) -> list[str]:
    lines = ["## Do the orders differ? Friedman test and Nemenyi ranks", "",
             "Blocks are graphs (units), treatments the orders, values the mean step time over seeds. Average rank "
             "1 = fastest. Two orders differ significantly (alpha = 0.05) when their average ranks differ by more "
             "than the Nemenyi critical difference CD.", ""]
    body = []
    by_placer = an.units_by_label(units)
    for placer, us in by_placer.items():
        groups = [("all families", us)] + [(f, [u for u in us if u.family == f])
                                           for f in sorted({u.family for u in us})]
        for label, g in groups:
            fr = an.friedman(g)
            ranked = sorted(fr["ranks"].items(), key=lambda kv: (kv[1], an.order_sort_key(kv[0])))
            top = ", ".join(f"{o} {r:.2f}" for o, r in ranked[:3])
            bottom = ", ".join(f"{o} {r:.2f}" for o, r in ranked[-2:]) if len(ranked) > 3 else ""
            body.append([placer, label, str(fr["n"]), str(fr["dropped"]), _num(fr["statistic"]), _p(fr["p"]),
                         _num(fr["cd"], ".2f"), top, bottom])
    lines += _table(["placer", "graphs", "N", "dropped", "chi2", "p (asymptotic)", "CD", "best ranks", "worst ranks"],
                    body)
    lines += ["", *(f"![critical difference, {p}]({f})" for p, f in cd_files.items()), ""]
    return lines


def _features_section(units: list[an.Unit]) -> list[str]:
    lines = ["## Graph features and the winning order", "",
             "Spearman correlation of each feature with each order's relative step time (rho > 0: the order falls "
             "further behind as the feature grows), the strongest per placer; and the features that best separate "
             "the graphs by their winning order (Kruskal-Wallis over the groups of graphs each order wins).", ""]
    for placer, us in an.units_by_label(units).items():
        corr = an.feature_correlations(us, FEATURE_NAMES)
        flat = [(f, o, r, p) for f, d in corr.items() for o, (r, p) in d.items() if not math.isnan(r)]
        flat.sort(key=lambda t: (-abs(t[2]), t[0], an.order_sort_key(t[1])))
        lines += [f"### {placer}", ""]
        lines += _table(["feature", "order", "rho", "p"], [[f, o, f"{r:+.2f}", _p(p)] for f, o, r, p in flat[:10]])
        sep = [s for s in an.feature_separation(us, FEATURE_NAMES) if not math.isnan(s["p"])][:5]
        if sep:
            lines += ["", *_table(["feature", "H", "p", "median per winning order"],
                                  [[s["feature"], f"{s['H']:.2f}", _p(s["p"]),
                                    ", ".join(f"{o} {v:.3g}" for o, v in s["medians"].items())] for s in sep])]
        else:
            lines += ["", "(one order wins every graph, or no feature varies: nothing to separate)"]
        lines += [""]
    return lines


def _recommend_section(units: list[an.Unit], model: Any) -> tuple[list[str], dict[str, Any]]:
    lines = ["## Recommendation rules and their validation", "",
             "One shallow regret tree per placer (depth <= 3; `devplace.study.recommend`): each leaf recommends the "
             "order with the smallest mean relative step time over its training graphs. Its complexity (always "
             "`topo`, one fixed order, depth 1, 2 or 3) is the one with the lowest leave-one-graph-out regret on "
             "the training graphs; the validation below repeats that choice inside every fold. Held-out validation: "
             "leave-one-family-out (fit on the other families) and leave-one-graph-out. *Regret* = step time with "
             "the recommended order / step time with the graph's best order - 1 (the per-graph oracle has 0); "
             "*fixed* = the single order best over the training graphs; *try 3* = the best of the leaf's 3 "
             "highest-ranked orders (`--order auto --try 3`); accuracy counts ties with the best as hits.",
             ""]
    results: dict[str, Any] = {}
    body = []
    for placer, us in an.units_by_placer(units).items():  # the order model's grouping: one tree per placer
        if placer not in model.doc["placers"]:
            continue
        sel = model.doc["placers"][placer].get("selection", {})
        scores = ", ".join(f"{k} {_pct(v)}" for k, v in sel.get("scores", {}).items())
        lines += [f"### {placer}", "", *(f"- {r}" for r in model.rules(placer)), ""]
        if scores:
            lines += [f"Chosen: {sel['chosen']} (leave-one-graph-out regret on all graphs: {scores}).", ""]
        for label, key in (("leave-one-family-out", lambda u: u.family), ("leave-one-graph-out", lambda u: u.graph)):
            v = validate(us, key)
            results[f"{placer}/{label}"] = {k: v[k] for k in v if k != "per_unit"}
            body.append([placer, label, str(v["units"]), _num(v["accuracy"], ".0%"), _num(v["topo_accuracy"], ".0%"),
                         _pct(v["regret"]), _pct(v["try_regret"]), _pct(v["topo_regret"]), _pct(v["fixed_regret"])])
    lines += ["Held-out results (units: a graph under one setting of the placer):", ""]
    lines += _table(["placer", "validation", "units", "accuracy (tree)", "accuracy (topo)", "regret (tree)",
                     "regret (try 3)", "regret (topo)", "regret (fixed)"], body)
    return [*lines, ""], results


def _family_question(summary: list[dict[str, Any]], units: list[an.Unit],
                     validation: dict[str, Any]) -> list[str]:
    lines = ["## Does the best order depend on the family?", "",
             "The seed study found that the best traversal order depends on the network family. Here, per placer: "
             "the best order of each family (by mean relative step time); whether, inside each family, another "
             "family's best order ranks significantly worse than this family's own best (Nemenyi, alpha = 0.05, "
             "on that family's graphs); and how a tree fitted on the other families does on a held-out family (the "
             "order model's tree is one per placer: a placer run under several settings has one tree for all, "
             "fitted on each setting's graphs as separate units).",
             ""]
    by_placer = an.units_by_label(units)
    tree_of = {u.label or u.placer: u.placer for u in units}  # a label's placer: whose tree was validated
    for placer in sorted({s["placer"] for s in summary}):
        entries = [s for s in summary if s["placer"] == placer]
        bests = {s["family"]: s["best"] for s in entries}
        spreads = ", ".join(f"{s['family']} {_pct(s['spread'])}" for s in entries)
        lofo = validation.get(f"{tree_of.get(placer, placer)}/leave-one-family-out", {})
        same = len(set(bests.values())) == 1
        verdict = (f"the same order ({next(iter(bests.values()))}) is best in every family" if same else
                   "the best order differs by family: " + ", ".join(f"{f} {o}" for f, o in bests.items()))
        # does it matter? inside family f, compare f's best with every other family's best by average rank
        tests = significant = 0
        cds: list[float] = []
        for f, own in bests.items():
            fr = an.friedman([u for u in by_placer.get(placer, []) if u.family == f])
            cds.append(fr["cd"])
            for other in {o for g, o in bests.items() if g != f and o != own}:
                if own in fr["ranks"] and other in fr["ranks"] and not math.isnan(fr["cd"]):
                    tests += 1
                    significant += fr["ranks"][other] - fr["ranks"][own] > fr["cd"]
        matters = (f" In {significant} of {tests} such comparisons another family's best order ranks "
                   f"significantly worse inside a family (critical difference {min(cds):.2f}-{max(cds):.2f} ranks "
                   f"of {len(an.orders_of(by_placer.get(placer, [])))}: with few graphs per family only large "
                   f"rank gaps count)." if tests else "")
        lines.append(f"- **{placer}**: {verdict}; spread between best and worst order {spreads}.{matters} On "
                     f"held-out families the tree's regret is {_pct(lofo.get('regret', math.nan))} against "
                     f"{_pct(lofo.get('fixed_regret', math.nan))} for one fixed order and "
                     f"{_pct(lofo.get('topo_regret', math.nan))} for `topo`.")
    return [*lines, ""]


def _question_tests(units: list[an.Unit]) -> dict[str, Any]:
    """The paper's question per placer: per family the permutation Friedman p, the mixed-model p (graph random,
    seeds replicates), both Holm-adjusted over the placer's families, the spread with its bootstrap interval
    and the noise with its interval; and the family x order interaction over all families."""
    out: dict[str, Any] = {}
    for placer, us in an.units_by_label(units).items():
        orders = an.orders_of(us)
        fams = []
        for family in sorted({u.family for u in us}):
            blocks, dropped = an.complete_units([u for u in us if u.family == family], orders)
            y, unbalanced = an.replicate_table(blocks, orders)
            p, method = an.friedman_permutation(np.array([[u.means()[o] for o in orders] for u in blocks])
                                                if blocks else np.zeros((0, len(orders))))
            fams.append({"family": family, "graphs": len(blocks), "dropped": dropped + unbalanced,
                         "replicates": y.shape[2], "p": p, "method": method, "mixed": an.mixed_anova(y),
                         "spread": an.bootstrap_spread(y) if len(y) else (math.nan,) * 3,
                         "noise": an.noise_interval(y) if len(y) else (math.nan,) * 3,
                         "range": an.spread_and_noise(y)[2] if len(y) else math.nan})
        for key, adjusted in (("p", "p_holm"), ("mixed", "mixed_holm")):
            ps = [f["p"] if key == "p" else f["mixed"]["p"] for f in fams]
            for f, q in zip(fams, an.holm(ps), strict=True):
                f[adjusted] = q
        blocks, _ = an.complete_units(us, orders)
        ranks = an.block_ranks(np.array([[u.means()[o] for o in orders] for u in blocks])) if blocks else np.zeros(
            (0, len(orders)))
        out[placer] = {"families": fams, "interaction": an.interaction_test(ranks, [u.family for u in blocks])}
    return out


def _survives(p: float, alpha: float = 0.05) -> str:
    return "n/a" if math.isnan(p) else ("**yes**" if p <= alpha else "no")


def _question_section(tests: dict[str, Any]) -> list[str]:
    lines = ["## The paper's question, tested", "",
             "The seed study claims that the traversal order changes the step time a placer reaches and that the "
             "best order depends on the network family. Per placer and family: Friedman's test by permutation "
             "(exact: every arrangement of each graph's ranks, when that is at most "
             f"{an.EXACT_LIMIT:,} evaluations; else {an.PERMUTATIONS:,} seeded random ones), which takes the "
             "studied graphs as they are; the order effect with graph as a random factor (mixed-model ANOVA of "
             "log step time, seeds as replicates: F = MS(order) / MS(order x graph)), which asks whether it holds "
             "for the family the graphs were drawn from; both Holm-adjusted over the placer's families. Effect "
             "sizes: the spread between the best and worst order (mean relative step time) with a 95% bootstrap "
             f"interval over graphs ({an.BOOTSTRAP:,} seeded resamples), the standard deviation of the order "
             "effect from the mixed model, and the seed-to-seed noise (pooled SD of log step time over a graph "
             "and order's seeds, 95% chi-square interval) with the largest max/min - 1 over one graph and "
             "order's seeds. SDs of log step time read as relative (0.01 ~ 1%). The spread is a max - min of noisy "
             "means, above 0 even where the orders do not differ: read it beside the noise and the tests.", ""]
    body = []
    for placer, t in tests.items():
        for f in t["families"]:
            mx = f["mixed"]
            sp, noise = f["spread"], f["noise"]
            body.append([placer, f["family"], str(f["graphs"]), str(f["replicates"]),
                         f"{_p(f['p'])} ({f['method']})", _p(f["p_holm"]),
                         _p(mx["p"]) + (f" (F {mx['F']:.2f})" if not math.isnan(mx["F"]) else ""), _p(f["mixed_holm"]),
                         f"{_pct(sp[0])} [{_pct(sp[1])}, {_pct(sp[2])}]", _num(mx["sd_order"], ".4f"),
                         _num(noise[0], ".4f") + ("" if math.isnan(noise[0]) else
                                                  f" [{noise[1]:.4f}, {noise[2]:.4f}]"), _pct(f["range"])])
    lines += _table(["placer", "family", "graphs", "runs", "Friedman p", "Holm", "graph random p", "Holm",
                     "spread [95% CI]", "order SD", "seed noise SD [95% CI]", "largest seed range"], body)
    lines += ["", "Family x order interaction (does the ranking of the orders depend on the family?): the orders' "
              "ranks within each graph, T = sum over families of n_f * ||family mean ranks - overall mean ranks||^2, "
              "against every relabelling of the graphs' families (family sizes kept).", ""]
    lines += _table(["placer", "graphs", "T", "p", "relabellings"],
                    [[placer, str(t["interaction"]["blocks"]), _num(t["interaction"]["statistic"], ".1f"),
                      _p(t["interaction"]["p"]),
                      f"{t['interaction']['arrangements']:,} ({t['interaction']['method']})"]
                     for placer, t in tests.items()])
    lines += ["", "Which claims survive (alpha = 0.05, Holm-adjusted over each placer's families):", ""]
    for placer, t in tests.items():
        fams = t["families"]
        fixed = [f["family"] for f in fams if f["p_holm"] <= 0.05]
        random_ = [f["family"] for f in fams if f["mixed_holm"] <= 0.05]
        weak = [f["family"] for f in fams if not math.isnan(f["noise"][0]) and f["mixed"]["sd_order"] < f["noise"][0]]
        it = t["interaction"]
        lines.append(
            f"- **{placer}**: the order matters on the graphs studied in {len(fixed)} of {len(fams)} families"
            + (f" ({', '.join(fixed)})" if fixed else "")
            + f"; with graph as a random factor in {len(random_)} of {len(fams)}"
            + (f" ({', '.join(random_)})" if random_ else "")
            + f". The best order depends on the family: {_survives(it['p'])} (interaction p = {_p(it['p'])})."
            + (" Effect against noise: " + "; ".join(
                f"{f['family']} spread {_pct(f['spread'][0])} [{_pct(f['spread'][1])}, {_pct(f['spread'][2])}], order "
                f"SD {f['mixed']['sd_order']:.2%} against seed noise SD {f['noise'][0]:.2%}" for f in fams
                if not math.isnan(f["noise"][0])) + "." if any(not math.isnan(f["noise"][0]) for f in fams) else "")
            + (f" One run's seed-to-seed noise SD exceeds the order effect's SD in {', '.join(weak)}." if weak
               else ""))
    return [*lines, ""]


FASTEST, FASTEST_CLASSIC = "fastest other", "fastest other but one device"


def _one_device_wins(entry: dict[str, Any]) -> bool:
    """True when one device is faster than every other placer (but the learned ones) of a `placer_comparison`
    entry."""
    classic = [t for p, (t, _) in entry["others"].items() if p != an.ONE_DEVICE]
    return bool(classic) and entry["others"][an.ONE_DEVICE][0] < min(classic)


def _settings_section(rows: Sequence[dict[str, Any]]) -> list[str]:
    comp = an.settings_comparison(rows)
    if not comp:
        return []
    lines = ["## One placer under two settings", "",
             "A placer the study ran under two settings (e.g. placeto under the seed's hyperparameters and under "
             "devplace's own), on the cells both ran: the same graph, order and seed. Ratio: the geometric mean of "
             "b's step over a's (below 1: b faster), its 95% interval a bootstrap over graphs (seeded); p: "
             "Wilcoxon signed-rank on the log ratios. The settings are never pooled in a test elsewhere in this "
             "report; only the recommendation tree, one per placer, learns from every setting's graphs.", ""]
    lines += _table(["placer", "a", "b", "family", "pairs", "graphs", "ratio b / a [95% CI]", "b faster in", "p"],
                    [[c["placer"], f"`{c['a']}`", f"`{c['b']}`", c["family"], str(c["pairs"]), str(c["graphs"]),
                      f"{c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]", f"{c['b_faster']:.0%}",
                      f"{c['p']:.3g}"] for c in comp])
    return [*lines, ""]


def _comparison_section(rows: Sequence[dict[str, Any]]) -> list[str]:
    comp = an.placer_comparison(rows)
    if not comp:
        return []
    lines = ["## Learned placers against the classic placers and one device", "",
             "Per graph: the learned placer at its best order (mean over seeds), and the mean over all its orders, "
             "divided by the fastest of every other placer the study ran (each at its best order; `single` is "
             "one device). Below 1 the learned placer is faster.", ""]
    lines += _table(["placer", "graph", "best order", "step", "fastest other", "its step", "ratio (best order)",
                     "ratio (mean of orders)"],
                    [[c["placer"], c["graph"], c["order"], f"{c['time'] * 1e3:.2f} ms",
                      f"{c['best_other']} ({c['others'][c['best_other']][1]})",
                      f"{c['others'][c['best_other']][0] * 1e3:.2f} ms",
                      f"{c['time'] / c['others'][c['best_other']][0]:.3f}",
                      f"{c['mean_time'] / c['others'][c['best_other']][0]:.3f}"] for c in comp])
    ranges: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in comp:
        for other, (t, _) in c["others"].items():
            ranges[(c["placer"], c["family"])][other].append(c["time"] / t)
        ranges[(c["placer"], c["family"])][FASTEST].append(c["time"] / c["others"][c["best_other"]][0])
        classic = [t for p, (t, _) in c["others"].items() if p != an.ONE_DEVICE]
        if classic:
            ranges[(c["placer"], c["family"])][FASTEST_CLASSIC].append(c["time"] / min(classic))
    extra = (FASTEST, FASTEST_CLASSIC)
    others = [*sorted({o for r in ranges.values() for o in r if o not in extra}), *extra]
    lines += ["", "Range over each family's graphs of the learned placer's best order / each other placer's best:",
              ""]
    lines += _table(["placer", "family", *others],
                    [[p, f, *(f"{min(r[o]):.3f}-{max(r[o]):.3f}" if r.get(o) else "n/a" for o in others)]
                     for (p, f), r in sorted(ranges.items())])
    # what holds by construction is not a finding: a learned placer's answer is the best placement it simulated,
    # judged against its start and every single device that fits (devplace.placers.rl.start.judged_best)
    against = [c["time"] / c["others"][an.ONE_DEVICE][0] for c in comp if an.ONE_DEVICE in c["others"]]
    if against:
        lines += ["", f"Not a finding: the learned placer's answer is at most one device's step time on "
                  f"{sum(r <= 1 + 1e-12 for r in against)} of {len(against)} graphs, which holds by construction (its "
                  "answer is the best placement it simulated, judged against its start and every single device that "
                  "fits; `devplace.placers.rl.start.judged_best`): the `single` column measures how far it got below "
                  f"one device, and `{FASTEST}` is below 1 wherever `single` is the fastest other. `{FASTEST_CLASSIC}` "
                  "is the comparison with the classic placers; one device is faster than every classic placer the "
                  f"study ran on {sum(_one_device_wins(c) for c in comp if an.ONE_DEVICE in c['others'])} of "
                  f"{len(against)} graphs, where beating them says little."]
    stayed = an.runs_at_one_device(rows)
    if stayed:
        orders = sorted({o for v in stayed.values() for o in v}, key=an.order_sort_key)
        lines += ["", "Runs whose answer is one device's step (a run from all on one device that found nothing "
                  "faster in its episodes; the rest found a faster placement), per order: such runs make an order "
                  "look worse without its learning anything different.", ""]
        lines += _table(["placer", "family", *orders],
                        [[p, f, *(f"{v[o][0]} of {v[o][1]}" if o in v else "n/a" for o in orders)]
                         for (p, f), v in stayed.items()])
    return [*lines, ""]


def write_report(db_path: str | Path, out_dir: str | Path, *, command: str | None = None) -> list[Path]:
    """Write report.md, results.csv, the PNG plots and order_model.json for the study in `db_path` into
    `out_dir`; returns the paths written. ReportError when there is nothing to report on."""
    with warnings.catch_warnings():
        # the libraries' warnings about degenerate input (matplotlib's empty heat map of a placer whose cells all
        # failed, numpy's mean of an empty slice) name the devplace line that called them, so the filter that
        # keeps devplace's own warnings would print them; the report says what is missing in its own words
        warnings.simplefilter("ignore")
        return _write_report(db_path, out_dir, command=command)


def _write_report(db_path: str | Path, out_dir: str | Path, *, command: str | None) -> list[Path]:
    rows = an.load_rows(db_path)
    if not rows:
        raise ReportError(f"{db_path} has no result rows; run `devplace study run ... --db {db_path}` first")
    units = an.build_units(rows)
    if not units:
        raise ReportError(f"{db_path}: no cell of a placer that walks the graph in an order; a study needs one of "
                          f"the sequential placers (see `devplace placers`) to compare orders")
    out = output_folder(out_dir, "-o")
    written: list[Path] = []
    features_csv = write_csv(rows, out / "results.csv")
    written += [out / "results.csv", features_csv]
    counts = an.cell_counts(rows)
    summary = an.family_summary(units)
    families = sorted({s["family"] for s in summary})
    for f in families:
        plot_family_bars(summary, f, out / f"bars_{_safe(f)}.png")
        written.append(out / f"bars_{_safe(f)}.png")
    plot_heatmap(summary, out / "heatmap.png")
    written.append(out / "heatmap.png")
    cd_files: dict[str, str] = {}
    for placer, us in an.units_by_label(units).items():
        fr = an.friedman(us)
        if fr["ranks"]:
            name = f"cd_{_safe(placer)}.png"
            plot_cd(fr, f"{placer}, all families", out / name)
            cd_files[placer] = name
            written.append(out / name)
    curve_files = []
    for placer in sorted({str(r.get("placer")) for r in rows}):
        name = f"curves_{_safe(placer)}.png"
        if plot_curves(rows, placer, out / name):
            curve_files.append(name)
            written.append(out / name)
    model = fit_order_model(rows, fitted_on={"database": str(db_path),
                                             "study": ", ".join(sorted({str(r.get("study")) for r in rows}))})
    model.save(out / "order_model.json")
    written.append(out / "order_model.json")
    rec_lines, validation = _recommend_section(units, model)
    write_output(out / "validation.json", json_text(validation, indent=1, sort_keys=True) + "\n", "report",
                 VALIDATION_JSON)
    written.append(out / "validation.json")

    title = ", ".join(sorted({str(r.get("study")) for r in rows}))
    md = [f"# Traversal-order study: {title}", ""]
    if command:
        md += ["Made with:", "", "```", command, "```", ""]
    md += [f"Results database: `{db_path}`; raw rows: [results.csv](results.csv), graph features: "
           "[features.csv](features.csv); fitted order model: [order_model.json](order_model.json).", ""]
    md += _setting(rows, units) + _counts(counts) + _family_tables(summary, families)
    md += _friedman_section(units, cd_files) + _features_section(units) + rec_lines
    md += _family_question(summary, units, validation) + _question_section(_question_tests(units))
    md += _comparison_section(rows) + _settings_section(rows)
    md += ["## Learning curves", ""]
    md += [f"![{f}]({f})" for f in curve_files] or ["No cell recorded a learning curve (no RL placer in this study)."]
    write_output(out / "report.md", "\n".join(md) + "\n", "report", REPORT_MD)
    written.append(out / "report.md")
    return written


def fixed_order_regret(units: Sequence[an.Unit], order: str) -> float:
    """Mean regret of always using `order` over the complete units (for benchmarks and docs)."""
    data = make_dataset(units)
    if order not in data.orders or not data.units:
        return math.nan
    return float(np.mean(data.R[:, data.orders.index(order)]) - 1)
