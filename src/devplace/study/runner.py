"""Run a study: prepare its graphs once (cached next to the database), then run every unfinished cell on a
backend and write one row per cell as it ends.

Resuming: a cell's row is written in one SQLite transaction when the cell ends, and nothing else is
written, so after a crash (kill -9 included) the database holds exactly the cells that finished; running
the same study again skips them. Failed cells are recorded (status "failed", the error) and skipped too,
unless `retry_failed`. A cell never stops the study: its errors become its row.

Graphs: zoo models and family members are captured (family members also costed and coarsened) once per study
(2-5 s each) in the backend's workers and saved as graph JSON under `<db>.graphs/`; cells load them from there
(the driver passes the loaded graph to the workers), so a rerun or a second study on the same database captures
nothing. A zoo model's cell costs its step for the cell's cluster and places it as `devplace place --model`
does (`model_prepared`; its pipelines on micro-batches captured at their own size, which are captured in the
cell).
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devplace.defaults import CANONICAL_ORDER
from devplace.files import output_folder
from devplace.graph.compgraph import CompGraph
from devplace.graph.semantics import semantics_of
from devplace.hardware.cluster import Cluster
from devplace.hardware.cost import cost_devices
from devplace.hardware.features import graph_features
from devplace.placers.search import request_settings
from devplace.planning import Placed, place_graph
from devplace.sim import lower_bound
from devplace.study.grid import Cell, expand
from devplace.study.spec import NO_ORDER, GraphRef, StudySpec, load_study, parallel_ask

if TYPE_CHECKING:  # the capture modules bring torch: imported where a zoo model is prepared
    from devplace.capture.pipeline import Prepared

RL_PLACERS = ("placeto", "seq2seq")
ERROR_MAX_CHARS = 4000


@dataclass(frozen=True)
class StudySummary:
    """What `run_study` did: cells in the grid, skipped (already in the database), run, failed among those."""

    study: str
    cells: int
    skipped: int
    ran: int
    failed: int
    wall_s: float
    db: str


# ---------------------------------------------------------------------------------------------- worker side
def prepare_graph(ref: GraphRef, max_nodes: int | None) -> CompGraph | str:
    """The prepared graph of a family member, or a zoo model's captured step (costed and coarsened per cell, for
    the cell's cluster: `model_prepared`), or the error text when it cannot be built."""
    try:
        from devplace.capture.custom import capture_named_model
        from devplace.capture.pipeline import family_graph

        if ref.family == "zoo":
            return capture_named_model(ref.name)
        return family_graph(ref.family, ref.index, max_nodes=max_nodes)
    except Exception as exc:  # recorded in the rows of this graph's cells
        return _error_text(exc)


def _error_text(exc: BaseException) -> str:
    from devplace.errors import DevplaceError

    text = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, DevplaceError):  # a bug or a library failure: keep where it happened
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-4:])
        text += "\n" + tb
    return text[:ERROR_MAX_CHARS]


def _versions() -> dict[str, str]:
    import torch

    import devplace

    return {"devplace": devplace.__version__, "torch": torch.__version__, "python": platform.python_version()}


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None  # JSON has no NaN or inf


def run_cell(cell: Cell, graph: CompGraph | str, cluster: Cluster) -> dict[str, Any]:
    """Run one cell and return its row (table `cells`); never raises: errors make a "failed" row."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {
        "key": cell.key, "study": cell.study, "graph": cell.graph.spec, "family": cell.graph.family,
        "cluster": cell.cluster.spec, "sim_model": cell.sim_model, "placer": cell.placer,
        "settings": cell.settings_json, "order_name": cell.order_name, "seed": cell.seed,
        "worker": f"{socket.gethostname()}:{os.getpid()}", "versions": _versions(),
    }
    try:
        if isinstance(graph, str):
            raise GraphPreparationError(graph)
        model = model_prepared(cell, graph, cluster)
        seen, step = (model.graph, model.full) if model is not None else (graph, graph)
        row.update(graph_name=seen.name, num_nodes=seen.num_nodes,
                   semantics=semantics_of(step, cell.semantics).value)
        row["features"] = {k: _finite(v) for k, v in graph_features(seen, cluster).items()}
        row["lower_bound_s"] = lower_bound(step, cluster).value_s
        # a zoo model is placed as `devplace place --model` places it: its groups judged on every op, pipelines on
        # micro-batches captured at their own size
        how: dict[str, Any] = {}
        if model is not None:
            from devplace.capture.custom import microbatch_graphs

            how = {"coarsening": model.coarsening, "full": model.full, "microbatch_graph": microbatch_graphs(model)}
        placed, curve, episodes = _place(cell, seen, cluster, how)
        result = placed.result
        row.update(placement_time_s=placed.placement_time_s, status="ok", step_time_s=float(result.step_time_s),
                   feasible=int(result.feasible), peak_memory_bytes=[float(b) for b in result.peak_memory_bytes],
                   episodes=episodes, curve=[float(x) for x in curve] if curve is not None else None)
    except Exception as exc:  # a failing cell is recorded and does not stop the study
        row.update(status="failed", step_time_s=None, error=_error_text(exc))
    row["wall_s"] = time.perf_counter() - t0
    row["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    return row


class GraphPreparationError(Exception):
    """The cell's graph could not be captured or loaded (the message is the original error)."""


def model_prepared(cell: Cell, graph: CompGraph, cluster: Cluster) -> Prepared | None:
    """A zoo model's captured step (`graph`) costed for the cell's cluster (`cost_devices`) and coarsened to the
    study's `max_nodes`, as `devplace place --model NAME -c CLUSTER --max-nodes N` prepares it; None for a family
    member or a graph file (placed as they are)."""
    if cell.graph.family != "zoo":
        return None
    from devplace.capture.custom import prepare_named

    device, kinds = cost_devices(cluster)
    return prepare_named(graph, cell.graph.name, max_nodes=cell.max_nodes, device=device, kinds=kinds)


def _place(cell: Cell, graph: CompGraph, cluster: Cluster,
           how: dict[str, Any]) -> tuple[Placed, list[float] | None, int | None]:
    """The placement simulated under the cell's model (`how`: a zoo model's coarsening, full graph and
    micro-batch graphs; the placer's `parallel` table asks for parallel plans, `study.spec.parallel_ask`), the
    learning curve of RL placers, and their episode count."""
    parallel, settings = parallel_ask(cell.settings)
    if parallel is not None:
        how = {**how, "parallel": parallel}
    if cell.policy_path is not None:
        settings["policy"] = str(cell.policy_path)  # as the study wrote it, read from the study's folder
    accepted = request_settings(cell.placer)
    if "sim_model" in accepted and "sim_model" not in settings:
        settings["sim_model"] = cell.sim_model  # RL placers learn under the study's simulation model
    order = CANONICAL_ORDER if cell.order_name == NO_ORDER else cell.order_name  # ignored by such placers
    episodes = int(settings.get("episodes", accepted.get("episodes"))) if cell.placer in RL_PLACERS else None
    if "log" in accepted:
        # the RL placers write their learning curve to a `log` file: read it back, one step time per episode
        # (placeto: the episode's final step time; seq2seq: the iteration's mean sampled step time). A `log`
        # the study gave becomes this cell's own file inside the study's folder; else a temporary one. Imported
        # here because the curve module brings torch.
        from devplace.placers.rl.curve import read_curve

        with tempfile.TemporaryDirectory(prefix="devplace-cell-") as tmp:
            own = cell.cell_log_path()
            if own is not None:
                own.parent.mkdir(parents=True, exist_ok=True)
            log = own if own is not None else Path(tmp) / "curve.csv"
            settings["log"] = str(log)
            placed = place_graph(graph, cluster, placer=cell.placer, order=order, seed=cell.seed,
                                 simulation_model=cell.sim_model, semantics=cell.semantics, **how, **settings)
            rows = read_curve(log) if log.is_file() else []
        return placed, [float(r["step_time_s"]) for r in rows if not r.get("greedy")], episodes
    placed = place_graph(graph, cluster, placer=cell.placer, order=order, seed=cell.seed,
                         simulation_model=cell.sim_model, semantics=cell.semantics, **how, **settings)
    return placed, None, episodes


# ---------------------------------------------------------------------------------------------- driver side
def graph_cache_dir(db: str | Path) -> Path:
    """Where a database's prepared graphs are cached: `<db>.graphs/` beside it."""
    p = Path(db)
    return p.parent / f"{p.name}.graphs"


# bump when prepared graphs change: cached ones made before are rebuilt (2: graphs carry their semantics; 3: a zoo
# model's is its captured step, prepared per cell)
GRAPH_CACHE_VERSION = 3


def _cache_file(cache: Path, ref: GraphRef, max_nodes: int | None) -> Path:
    tag = hashlib.sha256(f"{ref.identity()}|{max_nodes}|{GRAPH_CACHE_VERSION}".encode()).hexdigest()[:12]
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in ref.spec)
    return cache / f"{safe}-{tag}.json"


def _load_graphs(refs: list[GraphRef], max_nodes: int | None, cache: Path, backend: Any,
                 bar: Any) -> dict[str, CompGraph | str]:
    """spec -> prepared graph (or error text), capturing the ones not cached yet on the backend."""
    from devplace.graph import load_graph, save_graph

    out: dict[str, CompGraph | str] = {}
    missing: list[GraphRef] = []
    for ref in refs:
        try:
            if ref.path is not None:
                out[ref.spec] = load_graph(ref.path)
                continue
            f = _cache_file(cache, ref, max_nodes)
            if f.is_file():
                out[ref.spec] = load_graph(f)
            else:
                missing.append(ref)
        except Exception as exc:  # a bad graph file fails its cells, not the study
            out[ref.spec] = _error_text(exc)
    if not missing:
        return out
    output_folder(cache, "the study's graph cache")  # a file of that name: one line, not a traceback
    bar.start("graphs", len(missing))
    for spec, result in backend.run(prepare_graph, ((r.spec, (r, max_nodes)) for r in missing)):
        ref = next(r for r in missing if r.spec == spec)
        if isinstance(result, CompGraph):
            f = _cache_file(cache, ref, max_nodes)
            tmp = f.with_suffix(f".tmp{os.getpid()}")
            save_graph(result, tmp)
            os.replace(tmp, f)  # atomic: a crash never leaves half a graph in the cache
            result = load_graph(f)  # cells see the graph exactly as a resumed run will load it
        out[spec] = result
        bar.advance(failed=isinstance(result, str))
    return out


def run_study(spec_or_path: StudySpec | str | Path, db: str | Path, *, backend: str = "local", workers: int = 1,
              address: str | None = None, retry_failed: bool = False, progress: bool = False,
              cache_dir: str | Path | None = None, max_cells: int | None = None) -> StudySummary:
    """Run every cell of the study not yet in `db` and write one row per cell; return what was done.

    `spec_or_path` is a StudySpec, a TOML file, or a preset name (`devplace.study.spec.PRESETS`). `backend`
    is "local" (a process pool of `workers`) or "ray" (a local Ray cluster of `workers` CPUs, or the one at
    `address`). `retry_failed` reruns cells recorded as failed. `progress` shows a live progress bar.
    Prepared graphs are cached under `cache_dir` (default `<db>.graphs/`). A grid of more than `max_cells`
    cells (default DEVPLACE_MAX_CELLS or 1,000,000) is refused before any cell is made. One driver runs on
    a database at a time: a second one gets a StoreError (devplace.study.store.writer_lock).
    """
    from devplace.study.backends import check_backend
    from devplace.study.spec import PRESETS
    from devplace.study.store import connect, writer_lock

    t0 = time.perf_counter()
    if isinstance(spec_or_path, StudySpec):
        spec = spec_or_path
    else:
        is_preset = str(spec_or_path) in PRESETS and not Path(spec_or_path).exists()
        spec = load_study(spec_or_path, preset=is_preset, max_cells=max_cells)
    cells = expand(spec, max_cells=max_cells)
    check_backend(backend, workers, address)  # a refused run leaves no database behind
    con = connect(db)
    try:
        with writer_lock(db):
            try:
                return _run_cells(spec, cells, con, db, backend, workers, address, retry_failed, progress,
                                  cache_dir, t0)
            finally:
                con.close()  # before the lock's descriptor closes (see writer_lock)
    finally:
        con.close()


def _run_cells(spec: StudySpec, cells: list[Cell], con: Any, db: str | Path, backend: str, workers: int,
               address: str | None, retry_failed: bool, progress: bool, cache_dir: str | Path | None,
               t0: float) -> StudySummary:
    """run_study's work once the database is open and locked: run the unfinished cells, write their rows."""
    from devplace.hardware.cluster import load_cluster
    from devplace.study.backends import make_backend
    from devplace.study.store import finished_keys, write_cell

    done = finished_keys(con)
    todo = [c for c in cells if c.key not in done or (retry_failed and done[c.key] == "failed")]
    summary = StudySummary(spec.name, len(cells), len(cells) - len(todo), 0, 0, 0.0, str(db))
    if not todo:
        return replace(summary, wall_s=time.perf_counter() - t0)
    be = make_backend(backend, min(workers, len(todo)), address)  # a worker without a cell costs its memory only
    bar = _Bar(progress)
    failed = 0
    try:
        with bar:
            refs = list({c.graph.spec: c.graph for c in todo}.values())
            cache = Path(cache_dir) if cache_dir is not None else graph_cache_dir(db)
            graphs = _load_graphs(refs, spec.max_nodes, cache, be, bar)
            clusters = {c.spec: load_cluster(c.source) for c in spec.clusters}
            shared_graphs = {k: be.share(g) for k, g in graphs.items()}
            shared_clusters = {k: be.share(c) for k, c in clusters.items()}
            bar.start(f"{spec.name}", len(todo), skipped=summary.skipped)
            tasks = ((c.key, (c, shared_graphs[c.graph.spec], shared_clusters[c.cluster.spec])) for c in todo)
            for _key, row in be.run(run_cell, tasks):
                write_cell(con, row)
                failed += row["status"] == "failed"
                bar.advance(failed=row["status"] == "failed")
    finally:
        be.close()
    return replace(summary, ran=len(todo), failed=failed, wall_s=time.perf_counter() - t0)


class _InProcess:
    """A backend that runs each task here, in turn (`verify_study`'s few cells)."""

    def run(self, fn: Any, tasks: Any) -> Any:
        for key, args in tasks:
            yield key, fn(*args)


@dataclass(frozen=True)
class Rerun:
    """A stored cell run again (`verify_study`): its stored and new status and step time, and where the new learning
    curve first parts from the stored one (None: equal, or no curve). `same`: status, step time and curve equal
    bit for bit."""

    key: str
    what: str  # graph, placer with settings, order, seed
    stored: tuple[str, float | None]
    now: tuple[str, float | None]
    curve_parts_at: int | None
    same: bool


def verify_study(spec: StudySpec, db: str | Path, *, cells: int = 3, seed: int = 0,
                 keys: tuple[str, ...] = ()) -> list[Rerun]:
    """Rerun finished cells of `spec` stored in `db`, in this process, and compare each with its row: `keys`, or
    else `cells` of them drawn with `seed` (a study is reproducible when the same code gives every row again).
    A key that is not a finished cell of the study is a StudyError."""
    import numpy as np

    from devplace.hardware.cluster import load_cluster
    from devplace.study.spec import StudyError
    from devplace.study.store import read_cells

    by_key = {c.key: c for c in expand(spec)}
    stored = {r["key"]: r for r in read_cells(db, study=spec.name) if r["key"] in by_key}
    if keys:
        unknown = [k for k in keys if k not in stored]
        if unknown:
            raise StudyError(f"{', '.join(unknown)}: not a finished cell of study {spec.name!r} in {db}; the keys "
                             f"are the `key` column of its rows (`devplace study report` writes them to results.csv)")
        chosen = list(keys)
    else:
        if not stored:
            raise StudyError(f"{db} holds no finished cell of study {spec.name!r}: run it first (`devplace study run`)")
        order = sorted(stored)
        picks = np.random.default_rng(seed).choice(len(order), size=min(cells, len(order)), replace=False)
        chosen = [order[i] for i in sorted(picks)]
    refs = list({by_key[k].graph.spec: by_key[k].graph for k in chosen}.values())
    # the graphs as the study's cells saw them: its cache, or prepared and cached the same way
    graphs = _load_graphs(refs, spec.max_nodes, graph_cache_dir(db), _InProcess(), _Bar(False))
    out = []
    for key in chosen:
        cell, row = by_key[key], stored[key]
        new = run_cell(cell, graphs[cell.graph.spec], load_cluster(cell.cluster.source))
        a, b = row.get("curve") or [], new.get("curve") or []
        parts = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     None if len(a) == len(b) else min(len(a), len(b)))
        same = (row["status"], row["step_time_s"]) == (new["status"], new["step_time_s"]) and parts is None
        what = f"{cell.graph.spec} {cell.placer} {cell.settings_json} {cell.order_name} seed {cell.seed}"
        out.append(Rerun(key, what, (row["status"], row["step_time_s"]), (new["status"], new["step_time_s"]), parts,
                         same))
    return out


class _Bar:
    """A rich live progress bar (done / failed / remaining, ETA), or nothing when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None
        self._failed = 0
        self._done = 0
        self._total = 0

    def __enter__(self) -> _Bar:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total} done, {task.fields[failed]} failed, "
                           "{task.fields[left]} left{task.fields[skipped]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(stderr=True), transient=False)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def start(self, what: str, total: int, skipped: int = 0) -> None:
        self._failed, self._done, self._total = 0, 0, total
        if self._progress is not None:
            note = f" ({skipped} skipped: already in the database)" if skipped else ""
            self._task = self._progress.add_task(what, total=total, failed=0, left=total, skipped=note)

    def advance(self, failed: bool = False) -> None:
        self._done += 1
        self._failed += failed
        if self._progress is not None:
            self._progress.update(self._task, advance=1, failed=self._failed, left=self._total - self._done)

