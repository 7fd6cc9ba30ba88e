"""A small, structured study database for the report and recommendation tests (no runner needed).

Two families of 6 graphs: in family "fa" (low `branching_share`) `bfs` is the fastest order, in "fb" (high
`branching_share`) `topo` is; `dfs-preorder` is second everywhere, `random` is worst. Placers `greedy` and
`m-topo` (order effect as above) and `placeto` (with learning curves), plus `m-etf` which ignores the order.
Seeds 0 and 1 add a small deterministic jitter. Two cells failed and one is infeasible.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from devplace.graph.features import FEATURE_NAMES

COLUMNS = ("key", "study", "graph", "family", "graph_name", "num_nodes", "cluster", "sim_model", "placer",
           "settings", "order_name", "seed", "status", "step_time_s", "feasible", "lower_bound_s",
           "peak_memory_bytes", "placement_time_s", "episodes", "curve", "features", "error", "versions",
           "finished_at")
ORDERS = ("topo", "dfs-preorder", "bfs", "random")
# relative step time of every order in each family (1.0 = best)
EFFECT = {"fa": {"bfs": 1.0, "dfs-preorder": 1.1, "topo": 1.25, "random": 1.6},
          "fb": {"topo": 1.0, "dfs-preorder": 1.1, "bfs": 1.3, "random": 1.7}}
GRAPHS = 6


def features(family: str, index: int) -> dict[str, float]:
    """Every feature; `branching_share` separates the families, `nodes` varies within them."""
    feats = {name: 1.0 for name in FEATURE_NAMES}
    feats["nodes"] = 50.0 + 10 * index
    feats["branching_share"] = (0.1 if family == "fa" else 0.6) + 0.02 * index
    feats["comm_to_compute"] = 0.3 + 0.01 * index
    return feats


def fixture_rows(*, order_effect: dict[str, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """The rows of the fixture study (see the module docstring)."""
    effect = order_effect or EFFECT
    rows: list[dict[str, Any]] = []
    for family in sorted(effect):
        for i in range(GRAPHS):
            base = 1.0 + 0.1 * i
            for placer in ("greedy", "m-topo", "placeto", "m-etf"):
                orders = ("-",) if placer == "m-etf" else tuple(effect[family])
                for order in orders:
                    for seed in (0, 1):
                        rel = 1.0 if order == "-" else effect[family][order]
                        step = base * rel * (1 + 0.002 * seed)
                        row = {"key": f"{family}/{i}/{placer}/{order}/{seed}", "study": "fixture",
                               "graph": f"{family}/{i}", "family": family, "graph_name": f"{family}-{i}",
                               "num_nodes": 50 + 10 * i, "cluster": "3xGPU-placeto", "sim_model": "devplace",
                               "placer": placer, "settings": json.dumps({"episodes": 4} if placer == "placeto"
                                                                        else {}),
                               "order_name": order, "seed": seed, "status": "ok", "step_time_s": step,
                               "feasible": 1, "lower_bound_s": base * 0.5, "peak_memory_bytes": "[1, 2, 3]",
                               "placement_time_s": 0.01, "episodes": 4 if placer == "placeto" else None,
                               "curve": json.dumps([step * 1.5, step * 1.2, step * 1.05, step])
                               if placer == "placeto" else None,
                               "features": json.dumps(features(family, i)), "error": None,
                               "versions": json.dumps({"devplace": "0.1.0"}),
                               "finished_at": "2026-01-01T00:00:00+00:00"}
                        rows.append(row)
    # two failed cells and one infeasible one, on the second seed, so every order keeps a usable seed
    for r in rows:
        if r["key"] in ("fa/0/greedy/bfs/1", "fb/2/m-topo/topo/1"):
            r.update(status="failed", step_time_s=None, feasible=None,
                     error="NoFitError: nothing fits on 3xGPU-placeto")
        elif r["key"] == "fb/3/greedy/random/1":
            r.update(feasible=0)
    return rows


def write_fixture_db(path: Path, rows: list[dict[str, Any]] | None = None) -> Path:
    """Write `rows` (default: `fixture_rows()`) into a fresh `cells` table at `path`."""
    con = sqlite3.connect(str(path))
    with con:
        cols = ", ".join(c + (" TEXT PRIMARY KEY" if c == "key" else "") for c in COLUMNS)
        con.execute(f"CREATE TABLE cells ({cols})")
        for r in rows if rows is not None else fixture_rows():
            con.execute(f"INSERT INTO cells ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                        tuple(r.get(c) for c in COLUMNS))
    con.close()
    return path
