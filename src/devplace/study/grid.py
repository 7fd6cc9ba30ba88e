"""A study's grid: graphs x clusters x placers (with settings) x orders x seeds, one `Cell` each, with a
stable key.

The key hashes the cell's definition -- study name, graph (and a graph file's content), coarsening limit,
cluster (and a cluster file's content), simulation model, placement semantics, placer, settings, order and
seed -- and nothing
else, so it is the same in every run, process and machine, and changes whenever what the cell computes does.
A placer that ignores the traversal order gets one cell per seed with order_name "-", not one per order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devplace.study.spec import NO_ORDER, ClusterRef, GraphRef, StudySpec, cell_limit, count_cells, too_many_cells

# bump when the meaning of a cell changes, so old rows stop matching (2: the autograd rule, per-precision costs;
# 3: the placement semantics follows the graph -- family graphs op by op -- or the study's `semantics`)
KEY_VERSION = 3


@dataclass(frozen=True)
class Cell:
    """One task of the study: place `graph` on `cluster` with `placer` in `order_name` under `seed`."""

    key: str
    study: str
    graph: GraphRef
    cluster: ClusterRef
    sim_model: str
    max_nodes: int | None
    placer: str
    settings_json: str  # JSON, sorted keys
    order_name: str
    seed: int
    # the study's `semantics` override; None: the graph's own (the row records the one placed under)
    semantics: str | None = None
    # the placer's `log` setting resolved inside the study's folder; not part of the key (the setting as
    # written is), so moving the study's folder keeps its rows
    log_path: Path | None = field(default=None, compare=False)
    # the `policy` setting resolved against the study's folder; not part of the key either
    policy_path: Path | None = field(default=None, compare=False)

    @property
    def settings(self) -> dict[str, Any]:
        return json.loads(self.settings_json)

    def cell_log_path(self) -> Path | None:
        """This cell's own log file: the `log` setting's name with the cell key before the suffix
        (`logs/curve.csv` -> `logs/curve.<key>.csv`), so cells never write one file together."""
        if self.log_path is None:
            return None
        return self.log_path.with_name(f"{self.log_path.stem}.{self.key}{self.log_path.suffix}")

    def describe(self) -> str:
        """A short human label for progress lines and errors."""
        return f"{self.graph.spec} {self.cluster.spec} {self.placer} {self.order_name} seed {self.seed}"


def settings_json(settings: dict[str, Any]) -> str:
    """Canonical JSON of a settings table (sorted keys, no spaces)."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def cell_key(study: str, graph: GraphRef, cluster: ClusterRef, sim_model: str, max_nodes: int | None,
             placer: str, settings: str, order_name: str, seed: int, semantics: str | None = None) -> str:
    """The stable key: sha256 (first 24 hex digits) of the cell's definition as canonical JSON."""
    return _key_from_ids(study, graph.identity(), cluster.identity(), sim_model, max_nodes, placer, settings,
                         order_name, seed, semantics)

def expand(spec: StudySpec, *, max_cells: int | None = None) -> list[Cell]:
    """Every cell of the study, in a fixed order (graph, cluster, placer, order, seed).

    The cells are counted first: more than `max_cells` (default DEVPLACE_MAX_CELLS or 1,000,000) is a
    StudyError, raised before any cell is made.
    """
    from devplace.placers.search import request_walks_order

    limit, count = cell_limit(max_cells), count_cells(spec)
    if count > limit:
        raise too_many_cells(spec.source, count, limit)
    cells: list[Cell] = []
    # identities hash graph and cluster files: compute each once, not once per cell
    graph_ids = {g.spec: g.identity() for g in spec.graphs}
    cluster_ids = {c.spec: c.identity() for c in spec.clusters}
    for g in spec.graphs:
        for c in spec.clusters:
            for p in spec.placers:
                orders = p.orders if p.orders is not None else spec.orders
                if not request_walks_order(p.name):
                    orders = (NO_ORDER,)
                seeds = p.seeds if p.seeds is not None else spec.seeds
                sj = settings_json(p.settings)
                for o in orders:
                    for s in seeds:
                        key = _key_from_ids(spec.name, graph_ids[g.spec], cluster_ids[c.spec], spec.sim_model,
                                            spec.max_nodes, p.name, sj, o, s, spec.semantics)
                        cells.append(Cell(key=key, study=spec.name, graph=g, cluster=c, sim_model=spec.sim_model,
                                          max_nodes=spec.max_nodes, placer=p.name, settings_json=sj, order_name=o,
                                          seed=s, semantics=spec.semantics, log_path=p.log_path,
                                          policy_path=p.policy_path))
    seen: set[str] = set()
    dupes = [c.describe() for c in cells if c.key in seen or seen.add(c.key)]  # type: ignore[func-returns-value]
    if dupes:
        from devplace.study.spec import StudyError

        raise StudyError(f"{spec.source}: the study lists the same cell twice (e.g. {dupes[0]}); "
                         "remove the repeated placer entry")
    return cells


def _key_from_ids(study: str, graph_id: str, cluster_id: str, sim_model: str, max_nodes: int | None, placer: str,
                  settings: str, order_name: str, seed: int, semantics: str | None) -> str:
    doc = {"v": KEY_VERSION, "study": study, "graph": graph_id, "max_nodes": max_nodes, "cluster": cluster_id,
           "sim_model": sim_model, "semantics": semantics, "placer": placer, "settings": settings,
           "order": order_name, "seed": seed}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:24]
