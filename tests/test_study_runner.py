"""The study runner: TOML definitions, grid expansion and stable keys, the SQLite store, resuming after kill -9,
failing cells, the ray backend against the local one, and the CLI's errors. Tiny synthetic graphs only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devplace.graph import save_graph
from devplace.hardware.cluster import load_cluster, save_cluster
from devplace.placers import place
from devplace.study import expand, load_study, read_cells, run_study
from devplace.study.grid import Cell
from devplace.study.runner import run_cell
from devplace.study.spec import StudyError, parse_study
from devplace.study.store import COLUMN_NAMES, count_rows
from devplace.zoo.synthetic import layered_graph

CONTRACT_COLUMNS = ("key", "study", "graph", "family", "graph_name", "num_nodes", "cluster", "sim_model", "placer",
                    "settings", "order_name", "seed", "status", "step_time_s", "feasible", "lower_bound_s",
                    "peak_memory_bytes", "placement_time_s", "episodes", "curve", "features", "error", "versions",
                    "finished_at")


def _graphs(d: Path, n: int = 2, nodes: int = 30) -> None:
    for i in range(n):
        save_graph(layered_graph(nodes, width=5, seed=i), d / f"g{i}.json")


def _study(d: Path, body: str, name: str = "s.toml") -> Path:
    p = d / name
    p.write_text(body)
    return p


BASIC = """
name = "t"
graphs = ["g0.json", "g1.json"]
clusters = ["3xGPU-placeto"]
sim_model = "placeto"
orders = ["topo", "bfs"]
seeds = 2
[[placers]]
name = "m-topo"
[[placers]]
name = "single"
"""


def test_grid_expansion_and_stable_keys(tmp_path):
    _graphs(tmp_path)
    spec = load_study(_study(tmp_path, BASIC))
    cells = expand(spec)
    # m-topo: 2 graphs x 2 orders x 2 seeds; single ignores the order: 2 graphs x 2 seeds, order "-"
    assert len(cells) == 8 + 4
    assert {c.order_name for c in cells if c.placer == "single"} == {"-"}
    keys = [c.key for c in cells]
    assert len(set(keys)) == len(keys) and all(len(k) == 24 for k in keys)
    assert [c.key for c in expand(load_study(tmp_path / "s.toml"))] == keys  # same definition, same keys
    # the key follows what the cell computes: a new setting, or an edited graph file, gives new keys
    changed = expand(load_study(_study(tmp_path, BASIC.replace('name = "single"', 'name = "single"\nseeds = [5]'),
                                       "s2.toml")))
    assert {c.key for c in changed if c.placer == "m-topo"} == {c.key for c in cells if c.placer == "m-topo"}
    assert not {c.key for c in changed if c.placer == "single"} & set(keys)
    save_graph(layered_graph(30, width=5, seed=7), tmp_path / "g1.json")
    edited = expand(load_study(tmp_path / "s.toml"))
    same = {c.key for c in edited} & set(keys)
    assert same == {c.key for c in cells if c.graph.spec == "g0.json"}


def test_presets_load_and_have_the_documented_shape():
    paper = load_study("paper", preset=True)
    assert len(paper.graphs) == 96 and {g.family for g in paper.graphs} == {"cifar10", "ptb", "nmt"}
    assert paper.sim_model == "placeto" and [c.spec for c in paper.clusters] == ["3xGPU-placeto"]
    assert paper.placers[0].name == "placeto"
    assert paper.placers[0].settings == {"episodes": 50, "hyper": "placeto-paper"}
    assert {"lexicographic", "topo", "reversed-topo", "dfs-preorder", "dfs-postorder", "bfs"} <= set(paper.orders)
    assert len(paper.seeds) == 10 and len(expand(paper)) == 96 * len(paper.orders) * 10
    seed, full = load_study("seed", preset=True), load_study("seed-full", preset=True)
    # seed-full: seed's design at 8 graphs per family and 10 runs (issue 33 item 4)
    assert [(g.family, g.index) for g in full.graphs] == [(f, i) for f in ("cifar10", "ptb", "nmt") for i in range(8)]
    assert full.seeds == tuple(range(10)) and full.orders == seed.orders and len(full.orders) == 6
    assert (full.sim_model, full.semantics, full.max_nodes) == (seed.sim_model, seed.semantics, seed.max_nodes)
    # seed's placers, and placeto under devplace's own set (the first seed study's settings) at one seed, so that
    # the report compares the two sets (issue 33 item 1)
    assert [(p.name, p.settings, p.orders, p.seeds) for p in full.placers] == \
        [(p.name, p.settings, p.orders, p.seeds) for p in seed.placers[:1]] + \
        [("placeto", {"episodes": 50, "start": "device0"}, None, (0,))] + \
        [(p.name, p.settings, p.orders, p.seeds) for p in seed.placers[1:]]
    assert full.placers[0].settings == {"episodes": 50, "hyper": "placeto-paper"}
    assert sum(c.placer == "placeto" for c in expand(full)) == 24 * 6 * 11
    quick = load_study("quick", preset=True)
    assert {p.name for p in quick.placers} >= {"placeto", "greedy"}
    ext = load_study("extended", preset=True)
    assert {p.name for p in ext.placers} == {"greedy", "m-topo", "contiguous", "anneal", "placeto", "seq2seq"}
    assert all(g.family == "zoo" for g in ext.graphs) and len(ext.clusters) >= 3


@pytest.mark.parametrize(("body", "message"), [
    ("name = 'x'\ngraphs = ['g0.json']\nclusters = ['3xGPU-placeto']\nplacers = ['m-topo']\nbogus = 1", "unknown key"),
    ("graphs = ['g0.json']\nclusters = ['3xGPU-placeto']\nplacers = ['nope']", "unknown placer"),
    ("graphs = ['g0.json']\nclusters = ['3xGPU-placeto']\n[[placers]]\nname = 'anneal'\nsettings = {stepz = 3}",
     "has no setting 'stepz'"),
    ("graphs = ['g0.json']\nclusters = ['3xGPU-placeto']\nplacers = ['m-topo']\norders = ['sideways']",
     "unknown order"),
    ("graphs = ['cifar10/0-40']\nclusters = ['3xGPU-placeto']\nplacers = ['m-topo']", "outside 0-31"),
    ("graphs = ['zoo:nonet']\nclusters = ['3xGPU-placeto']\nplacers = ['m-topo']", "unknown zoo model"),
    ("graphs = ['missing.json']\nclusters = ['3xGPU-placeto']\nplacers = ['m-topo']", "existing graph file"),
    ("graphs = ['g0.json']\nclusters = ['9xTPU']\nplacers = ['m-topo']", "neither a cluster preset"),
    ("graphs = ['g0.json']\nclusters = ['3xGPU-placeto']\nplacers = ['m-topo']\nsim_model = 'fast'",
     "sim_model"),
    ("graphs = ['g0.json']\nplacers = ['m-topo']", "missing key 'clusters'"),
    ("graphs = ['g0.json'\n", "not valid TOML"),
])
def test_bad_definitions_are_clear_errors(tmp_path, body, message):
    _graphs(tmp_path, 1)
    with pytest.raises(StudyError, match=message):
        parse_study(body, base_dir=tmp_path, source="bad.toml")


def test_cli_bad_toml_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    from devplace.cli import main

    bad = _study(tmp_path, "graphs = [\n", "bad.toml")
    for args in (["study", "run", str(bad), "--db", str(tmp_path / "r.sqlite")],
                 ["study", "run", "--preset", "huge", "--db", str(tmp_path / "r.sqlite")],
                 ["study", "run", "--db", str(tmp_path / "r.sqlite")]):
        monkeypatch.setattr(sys, "argv", ["devplace", *args])
        with pytest.raises(SystemExit) as exc:
            main()
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.sqlite").exists()


@pytest.mark.parametrize(("placer", "sim_model", "order", "settings"), [
    ("placeto", "placeto", "dfs-preorder", {"episodes": 2}),
    ("seq2seq", "devplace", "bfs", {"episodes": 2, "samples": 2, "hidden": 8}),
])
def test_rl_cell_gives_place_s_placement_and_a_curve(tmp_path, placer, sim_model, order, settings):
    # run_cell reads the RL placer's learning curve from its log: the placement must still be place()'s
    _graphs(tmp_path, 1)
    toml_settings = ", ".join(f"{k} = {v}" for k, v in settings.items())
    spec = parse_study(f'graphs = ["g0.json"]\nclusters = ["3xGPU-placeto"]\nsim_model = "{sim_model}"\n'
                       f'orders = ["{order}"]\n[[placers]]\nname = "{placer}"\nsettings = {{{toml_settings}}}',
                       base_dir=tmp_path)
    (cell,) = expand(spec)
    g, c = layered_graph(30, width=5, seed=0), load_cluster("3xGPU-placeto")
    row = run_cell(cell, g, c)
    assert row["status"] == "ok", row["error"]
    assert row["episodes"] == 2 and len(row["curve"]) == 2
    ref = place(g, c, placer=placer, order=order, seed=0, sim_model=sim_model, **settings).to_array(g, c.num_devices)
    from devplace.sim import simulate

    assert row["step_time_s"] == simulate(g, c, ref, model=sim_model).step_time_s
    assert set(CONTRACT_COLUMNS) <= set(COLUMN_NAMES) and set(row) <= set(COLUMN_NAMES)


def test_placeto_paper_cell_stores_every_episode_and_the_training_curve(tmp_path):
    # issue 33: under the seed's set, `episodes` counts the evaluations (episodes 0 and 5 of 6), the curve does not
    _graphs(tmp_path, 1)
    spec = parse_study('graphs = ["g0.json"]\nclusters = ["3xGPU-placeto"]\nsim_model = "placeto"\norders = ["topo"]\n'
                       '[[placers]]\nname = "placeto"\n'
                       'settings = { episodes = 6, hyper = "placeto-paper", hidden = 4, rounds = 1 }',
                       base_dir=tmp_path)
    (cell,) = expand(spec)
    row = run_cell(cell, layered_graph(30, width=5, seed=0), load_cluster("3xGPU-placeto"))
    assert row["status"] == "ok", row["error"]
    assert row["episodes"] == 6 and len(row["curve"]) == 4


def test_failing_cells_are_recorded_and_retried_on_request(tmp_path):
    _graphs(tmp_path, 1)
    (tmp_path / "broken.json").write_text("{not json")
    tiny = load_cluster("3xGPU-placeto")
    from dataclasses import replace

    small = replace(tiny, name="tiny-mem", devices=tuple(replace(d, memory_bytes=1e6) for d in tiny.devices))
    save_cluster(small, tmp_path / "tiny.json")
    body = ('name = "f"\ngraphs = ["g0.json", "broken.json"]\nclusters = ["3xGPU-placeto", "tiny.json"]\n'
            'orders = ["topo"]\nplacers = ["m-topo"]\n')
    db = tmp_path / "r.sqlite"
    s = run_study(load_study(_study(tmp_path, body)), db, workers=1)
    rows = {(r["graph"], r["cluster"]): r for r in read_cells(db)}
    assert s.cells == 4 and s.ran == 4 and s.failed == 3 and len(rows) == 4
    ok = rows[("g0.json", "3xGPU-placeto")]
    assert ok["status"] == "ok" and ok["step_time_s"] > 0 and ok["feasible"] == 1 and ok["error"] is None
    nofit = rows[("g0.json", "tiny.json")]
    assert nofit["status"] == "failed" and nofit["step_time_s"] is None and "NoFitError" in nofit["error"]
    assert nofit["features"]["nodes"] == 30  # the graph was fine: its features are still recorded
    assert "broken.json" in rows[("broken.json", "3xGPU-placeto")]["error"]
    raw = read_cells(db, decode=False)
    assert all(isinstance(r["settings"], str) and isinstance(r["versions"], str) for r in raw)
    again = run_study(load_study(tmp_path / "s.toml"), db, workers=1)
    assert again.ran == 0 and again.skipped == 4
    retried = run_study(load_study(tmp_path / "s.toml"), db, workers=1, retry_failed=True)
    assert retried.ran == 3 and retried.failed == 3 and count_rows(db) == 4


def test_resume_after_kill_9_gives_exactly_the_full_set_of_rows(tmp_path):
    _graphs(tmp_path, 2, nodes=40)
    body = ('name = "k"\ngraphs = ["g0.json", "g1.json"]\nclusters = ["3xGPU-placeto"]\nsim_model = "placeto"\n'
            'orders = ["topo", "bfs", "dfs-preorder"]\nseeds = 2\n'
            '[[placers]]\nname = "placeto"\nsettings = {episodes = 2}\n')
    study = _study(tmp_path, body)
    db = tmp_path / "r.sqlite"
    total = len(expand(load_study(study)))
    proc = subprocess.Popen([sys.executable, "-m", "devplace", "study", "run", str(study), "--db", str(db),
                             "--workers", "1", "--quiet"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while count_rows(db) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its worker processes, mid-study
    proc.wait()
    at_kill = count_rows(db)
    assert 2 <= at_kill < total, f"study was not killed mid-run ({at_kill}/{total} rows)"
    s = run_study(load_study(study), db, workers=1)
    assert s.skipped == at_kill and s.ran == total - at_kill and s.failed == 0
    rows = read_cells(db)
    assert sorted(r["key"] for r in rows) == sorted(c.key for c in expand(load_study(study)))
    assert all(r["status"] == "ok" and r["step_time_s"] > 0 for r in rows)


def test_ray_backend_gives_the_same_rows_as_local(tmp_path):
    pytest.importorskip("ray")
    _graphs(tmp_path, 1)
    body = ('name = "r"\ngraphs = ["g0.json"]\nclusters = ["3xGPU-placeto"]\nsim_model = "placeto"\n'
            'orders = ["topo", "bfs"]\nseeds = [3]\n[[placers]]\nname = "m-topo"\n'
            '[[placers]]\nname = "placeto"\nsettings = {episodes = 1}\n')
    spec = load_study(_study(tmp_path, body))
    s = run_study(spec, tmp_path / "ray.sqlite", backend="ray", workers=1)
    assert s.ran == 4 and s.failed == 0
    # the local backend runs run_cell in a pool process; in this process it computes the same rows (the pool
    # itself is covered by the other tests, and starting one here would double this test's time)
    from devplace.graph import load_graph

    g, c = load_graph(tmp_path / "g0.json"), load_cluster("3xGPU-placeto")
    local = {cell.key: run_cell(cell, g, c) for cell in expand(spec)}
    remote = {r["key"]: r for r in read_cells(tmp_path / "ray.sqlite")}
    assert local.keys() == remote.keys()
    for k, row in local.items():
        assert row["step_time_s"] == remote[k]["step_time_s"] and remote[k]["status"] == "ok"
        assert row["curve"] == remote[k]["curve"] and row["features"] == remote[k]["features"]
        assert row["worker"] != remote[k]["worker"]  # it really ran elsewhere


def test_cell_dataclass_roundtrips_settings():
    cells = expand(parse_study('graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\n'
                               '[[placers]]\nname = "anneal"\nsettings = {steps = 10, start = "m-topo"}',
                               base_dir=Path.cwd()))
    (cell,) = cells
    assert isinstance(cell, Cell) and cell.settings == {"start": "m-topo", "steps": 10}
    assert cell.settings_json == '{"start":"m-topo","steps":10}' and cell.graph.family == "cifar10"


class _InlineBackend:
    """Runs tasks in this process (so a monkeypatched capture is seen)."""

    def run(self, fn, tasks):
        for tag, args in tasks:
            yield tag, fn(*args)


class _Bar:
    def start(self, *a, **k):
        pass

    def advance(self, *a, **k):
        pass


def test_graphs_are_prepared_once_and_cached(tmp_path, monkeypatch):
    import devplace.capture.pipeline as pipeline
    from devplace.study.runner import _load_graphs

    calls = []

    def fake_family_graph(family, index, *, max_nodes=None, **_):
        calls.append((family, index, max_nodes))
        if family == "nmt":
            raise RuntimeError("capture failed")
        return layered_graph(20, width=4, seed=index, name=f"{family}-{index}")

    monkeypatch.setattr(pipeline, "family_graph", fake_family_graph)
    spec = parse_study('graphs = ["cifar10/0-1", "nmt/2"]\nclusters = ["3xGPU-placeto"]\nplacers = ["m-topo"]\n'
                       'max_nodes = 40', base_dir=tmp_path)
    got = _load_graphs(list(spec.graphs), 40, tmp_path / "cache", _InlineBackend(), _Bar())
    assert sorted(calls) == [("cifar10", 0, 40), ("cifar10", 1, 40), ("nmt", 2, 40)]
    assert got["cifar10/1"].name == "cifar10-1" and "capture failed" in got["nmt/2"]
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2  # failures are not cached: retried next run
    again = _load_graphs(list(spec.graphs), 40, tmp_path / "cache", _InlineBackend(), _Bar())
    assert len(calls) == 4 and calls[-1][0] == "nmt"  # only the failed one is captured again
    assert again["cifar10/0"].num_nodes == 20


def test_store_rejects_files_that_are_not_results_databases(tmp_path):
    from devplace.study.store import StoreError, connect

    with pytest.raises(StoreError, match="no such results database"):
        read_cells(tmp_path / "none.sqlite")
    junk = tmp_path / "junk.sqlite"
    junk.write_text("this is not sqlite, just a text file of some length " * 40)
    with pytest.raises(StoreError, match="not a devplace study database"):
        connect(junk)


def test_a_pipeline_cell_is_timed_under_its_schedule(tmp_path):
    # the pipeline placer returns a schedule: the row's step time is the pipelined step place() reports
    _graphs(tmp_path, 1)
    spec = parse_study('graphs = ["g0.json"]\nclusters = ["3xGPU-placeto"]\nsim_model = "devplace"\n'
                       'orders = ["topo"]\n[[placers]]\nname = "pipeline"\nsettings = {microbatches = 4}',
                       base_dir=tmp_path)
    (cell,) = expand(spec)
    g, c = layered_graph(30, width=5, seed=0), load_cluster("3xGPU-placeto")
    row = run_cell(cell, g, c)
    assert row["status"] == "ok", row["error"]
    ref = place(g, c, placer="pipeline", order="topo", seed=0, microbatches=4)
    assert ref.schedule.microbatches == 4
    assert row["step_time_s"] == ref.meta["step_time_s"]
    from devplace.sim import simulate

    assert row["step_time_s"] < simulate(g, c, ref).step_time_s  # not the unpipelined step of those devices


def test_verify_reruns_stored_cells_and_finds_a_changed_row(tmp_path, capsys, monkeypatch):
    """`devplace study verify`: stored cells rerun give their rows bit for bit (a placeto cell's curve too); a row
    changed in the database is found (exit 1), an unknown key is a one-line error (exit 2)."""
    import sqlite3

    from devplace.cli import main
    from devplace.study.runner import verify_study

    _graphs(tmp_path, 1)
    spec_file = _study(tmp_path, 'name = "v"\ngraphs = ["g0.json"]\nclusters = ["3xGPU-placeto"]\n'
                                 'sim_model = "placeto"\norders = ["topo", "bfs"]\n[[placers]]\nname = "m-topo"\n'
                                 '[[placers]]\nname = "placeto"\nsettings = { episodes = 3, hidden = 4, rounds = 1 }\n')
    db = tmp_path / "r.sqlite"
    run_study(load_study(spec_file), db, workers=1)
    reruns = verify_study(load_study(spec_file), db, cells=4)
    assert len(reruns) == 4 and all(r.same for r in reruns)
    placeto = next(r for r in read_cells(db) if r["placer"] == "placeto")
    assert len(placeto["curve"]) == 3
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE cells SET step_time_s = step_time_s * 1.01 WHERE key = ?", (placeto["key"],))
    con.close()
    monkeypatch.setattr(sys, "argv", ["devplace", "study", "verify", str(spec_file), "--db", str(db),
                                      "--key", placeto["key"]])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 1 and "differ" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["devplace", "study", "verify", str(spec_file), "--db", str(db), "--key", "nokey"])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "nokey" in err and len(err.strip().splitlines()) == 1
