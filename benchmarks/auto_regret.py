"""Regret of `--order auto` on networks of kinds the study never saw, and held out by family on the study's rows.

Regret = step time with the chosen order / step time with the graph's best order - 1, the best taken over every
order, `random` (seed 0) included, although `--order auto` never picks `random`. Columns, side by side:

- `topo`: always `topo`, DESIGN.md's canonical order;
- `tree`: the shipped order model's choice (`recommend_order(...).order`; `topo` for a placer without a tree);
- `try 3`: the best of the model's 3 highest-ranked orders (`--try 3`);
- `auto`: `place(..., order="auto")` as it is now, placed for real (a cheap placer tries every candidate order);
- `no lex`: the best order but `random` and `lexicographic` (whose placement depends on how ops are named);
- `time x`: auto's placement time / one placement with `topo` (what the trying costs).

    PYTHONPATH=src .venv/bin/python benchmarks/auto_regret.py unseen            # captures once, cached in /tmp
    PYTHONPATH=src .venv/bin/python benchmarks/auto_regret.py study docs/study/results.csv

`unseen` captures torchvision vit_b_16, convnext_tiny, swin_t, efficientnet_b0, regnet_y_400mf, densenet121, a
BART-base built from a transformers config (no download) and a two-tower recommender defined here, at small
batch sizes, prepared with `max_nodes=200`, on 4xV100-16GB; the prepared graphs are cached as JSON under
/tmp/devplace-auto-regret. `study` reads the study's rows (results.csv has no graph features, so the tree cannot
be refitted from it): per held-out family it compares always-`topo`, the one order best on the other families,
and trying every order the study ran but `random` (what `auto` does for a cheap placer).
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import load_cluster
from devplace.orders import ORDERS
from devplace.orders.auto import recommend_order
from devplace.placers import place

PLACERS = ("greedy", "m-etf", "contiguous")
CLUSTER = "4xV100-16GB"
CACHE = Path("/tmp/devplace-auto-regret")
MAX_NODES = 200


def _torchvision(name: str, batch: int = 8) -> Callable[[], tuple[Any, Any, Any]]:
    def build() -> tuple[Any, Any, Any]:
        import torch
        import torchvision

        # built on the CPU, not the meta device: regnet's constructor computes its widths with tensors
        with torch.device("cpu"):
            model = getattr(torchvision.models, name)(weights=None)
            return model, torch.zeros(batch, 3, 224, 224), None
    return build


def _bart_base(batch: int = 4, seq: int = 128) -> tuple[Any, Any, Any]:
    """BART-base's shape (6+6 layers, d_model 768, 12 heads, FFN 3072) from a config: nothing is downloaded."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                     decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                     max_position_embeddings=1024)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return BartForConditionalGeneration(cfg), {"input_ids": ids, "labels": ids}, None


def _two_tower(batch: int = 512) -> tuple[Any, Any, Any]:
    """A two-tower recommender: user and item towers (ID embeddings + dense features -> MLP), dot-product
    score, binary cross-entropy against a click label."""
    import torch
    from torch import nn

    class Tower(nn.Module):
        def __init__(self, ids: int, dense: int) -> None:
            super().__init__()
            self.emb = nn.Embedding(ids, 64)
            self.side = nn.EmbeddingBag(10_000, 32, mode="mean")
            self.mlp = nn.Sequential(nn.Linear(64 + 32 + dense, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                     nn.Linear(256, 128))

        def forward(self, ids: torch.Tensor, hist: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
            return self.mlp(torch.cat([self.emb(ids), self.side(hist), dense], dim=1))

    class TwoTower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user, self.item = Tower(1_000_000, 16), Tower(200_000, 8)

        def forward(self, u: torch.Tensor, uh: torch.Tensor, ud: torch.Tensor, i: torch.Tensor, ih: torch.Tensor,
                    idn: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            score = (self.user(u, uh, ud) * self.item(i, ih, idn)).sum(dim=1)
            return nn.functional.binary_cross_entropy_with_logits(score, y)

    b = batch
    z = torch.zeros
    inputs = (z(b, dtype=torch.long), z(b, 20, dtype=torch.long), z(b, 16), z(b, dtype=torch.long),
              z(b, 20, dtype=torch.long), z(b, 8), z(b))
    return TwoTower(), inputs, None


MODELS: dict[str, Callable[[], tuple[Any, Any, Any]]] = {
    **{n: _torchvision(n) for n in ("vit_b_16", "convnext_tiny", "swin_t", "efficientnet_b0", "regnet_y_400mf",
                                    "densenet121")},
    "bart-base": _bart_base,
    "two-tower": _two_tower,
}


def unseen_graph(name: str) -> CompGraph:
    """The prepared graph of `name` (built on the meta device unless its builder says otherwise, captured,
    prepared with max_nodes=200), cached as JSON."""
    from devplace.graph.io import load_graph, save_graph

    path = CACHE / f"{name}.json"
    if path.exists():
        return load_graph(path)
    import torch

    from devplace.capture import capture
    from devplace.capture.pipeline import prepare

    with torch.device("meta"):
        module, inputs, loss_fn = MODELS[name]()
    g = prepare(capture(module, inputs, loss_fn=loss_fn, name=name), max_nodes=MAX_NODES).graph
    CACHE.mkdir(parents=True, exist_ok=True)
    save_graph(g, path)
    return g


def _regret(x: float, best: float) -> float:
    return x / best - 1 if math.isfinite(x) else math.inf


def run_unseen(names: list[str]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cluster = load_cluster(CLUSTER)
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    print(f"{'graph':<16} {'placer':<11} {'nodes':>5} {'topo':>7} {'tree':>7} {'try 3':>7} {'auto':>7} "
          f"{'no lex':>7} {'time x':>7}  tree -> auto")
    for name in names:
        t0 = time.perf_counter()
        g = unseen_graph(name)
        prep_s = time.perf_counter() - t0
        for placer in PLACERS:
            place(g, cluster, placer=placer, order="topo")  # warm-up: numba compiles and caches on first use
            steps: dict[str, float] = {}
            topo_s = math.nan
            for o in ORDERS:
                t = time.perf_counter()
                try:
                    steps[o] = place(g, cluster, placer=placer, order=o).meta["step_time_s"]
                except DevplaceError:  # over memory with this order
                    steps[o] = math.inf
                if o == "topo":
                    topo_s = time.perf_counter() - t
            best = min(steps.values())
            rec = recommend_order(g, cluster, placer=placer)
            t = time.perf_counter()
            auto = place(g, cluster, placer=placer, order="auto")
            auto_s = time.perf_counter() - t
            r = {"topo": _regret(steps["topo"], best), "tree": _regret(steps[rec.order], best),
                 "try 3": _regret(min(steps[o] for o in rec.ranking[:3]), best),
                 "auto": _regret(auto.meta["step_time_s"], best), "time x": auto_s / topo_s,
                 "no lex": _regret(min(t for o, t in steps.items() if o not in ("random", "lexicographic")), best)}
            rows[placer].append(r)
            print(f"{name:<16} {placer:<11} {g.num_nodes:>5} {r['topo']:>7.2%} {r['tree']:>7.2%} {r['try 3']:>7.2%} "
                  f"{r['auto']:>7.2%} {r['no lex']:>7.2%} {r['time x']:>7.1f}  {rec.order} -> {auto.meta['order']}"
                  f"  (auto {auto_s:.3f} s, prepared in {prep_s:.0f} s)", flush=True)
    _summary(rows)


def _summary(rows: dict[str, list[dict[str, float]]]) -> None:
    cols = [c for c in ("topo", "tree", "fixed", "try 3", "auto", "no lex") if c in next(iter(rows.values()))[0]]
    print(f"\n{'placer':<18} {'graphs':>6} " + " ".join(f"{c + ' mean':>10} {c + ' max':>9}" for c in cols)
          + (f" {'time x':>7}" if "time x" in next(iter(rows.values()))[0] else ""))
    for placer, rs in rows.items():
        line = f"{placer:<18} {len(rs):>6} "
        line += " ".join(f"{np.mean([r[c] for r in rs]):>10.2%} {max(r[c] for r in rs):>9.2%}" for c in cols)
        if "time x" in rs[0]:
            line += f" {np.mean([r['time x'] for r in rs]):>7.1f}"
        print(line)


def run_study(path: str) -> None:
    """Held out by family on the study's rows: per (graph, cluster, sim model, placer) unit, each order's mean
    step time over seeds."""
    times: dict[tuple[str, ...], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    family: dict[tuple[str, ...], str] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["placer"] not in (*PLACERS, "m-topo") or row["status"] != "ok" or row["feasible"] != "1":
                continue
            key = (row["graph"], row["cluster"], row["sim_model"], row["placer"])
            times[key][row["order_name"]].append(float(row["step_time_s"]))
            family[key] = row["family"]
    units = {k: {o: float(np.mean(v)) for o, v in t.items()} for k, t in times.items()}
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    for placer in sorted({k[3] for k in units}):
        mine = {k: u for k, u in units.items() if k[3] == placer}
        for fam in sorted({family[k] for k in mine}):
            train = [u for k, u in mine.items() if family[k] != fam]
            shared = set.intersection(*(set(u) for u in train)) - {"random"}
            # the single order with the smallest mean relative step time on the other families
            fixed = min(sorted(shared), key=lambda o: np.mean([u[o] / min(u.values()) for u in train]))
            for k, u in mine.items():
                if family[k] != fam:
                    continue
                best = min(u.values())
                tried = min(t for o, t in u.items() if o != "random")
                r = {"topo": _regret(u["topo"], best), "fixed": _regret(u.get(fixed, math.inf), best),
                     "auto": _regret(tried, best)}
                rows[f"{placer} {fam}"].append(r)
                rows[f"{placer} all"].append(r)
    print(f"{path}: {len(units)} units; regret against the best order, random included; 'fixed' = the one order "
          f"best on the other families; 'auto' = best of every order the study ran but random")
    _summary(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "study":
        run_study(sys.argv[2] if len(sys.argv) > 2 else "docs/study/results.csv")
    else:
        run_unseen(sys.argv[2].split(",") if len(sys.argv) > 2 else list(MODELS))
