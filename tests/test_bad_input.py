"""Hostile and broken input below the CLI (issue 14 items 4 and 6-10): huge numbers, unbounded files and
grids, bad study files and settings, foreign and read-only databases, killed drivers, concurrent drivers, and
the anneal and policy-file messages. Tiny graphs only."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from conftest import cluster, run_cli
from devplace.errors import ClusterError, FormatError, GraphError
from devplace.files import MAX_INPUT_ENV
from devplace.graph import CompGraph, load_graph, save_graph
from devplace.graph.compgraph import MAX_NAME_CHARS, MAX_TOTAL
from devplace.graph.jsonio import read_json
from devplace.hardware.cluster import Cluster, load_cluster
from devplace.placers import NoFitError, place
from devplace.sim import lower_bound, simulate
from devplace.study import expand, load_study, read_cells, run_study
from devplace.study.runner import run_cell
from devplace.study.spec import MAX_CELLS_ENV, StudyError, parse_study
from devplace.study.store import StoreError, connect, count_rows
from devplace.zoo.synthetic import layered_graph


def _graph_file(path: Path, nodes: list[dict], edges: list[dict] | None = None, name: str = "g") -> Path:
    path.write_text(json.dumps({"format": "devplace.graph/1", "name": name, "nodes": nodes, "edges": edges or []}))
    return path


def _cluster_doc(**device: object) -> dict:
    dev = {"name": "d", "memory_bytes": 1e9, **device}
    return {"format": "devplace.cluster/1", "name": "c", "devices": [dev, dict(dev, name="e")],
            "link": {"bandwidth_Bps": 1e9, "latency_s": 0.0}}


def _one_error_line(code: int, out: str, err: str) -> str:
    text = (out + err).strip()
    assert code == 2 and text.startswith("error:") and "\n" not in text, (code, out, err)
    return text


# ------------------------------------------------------------------------------------ item 4: huge numbers
def test_totals_that_overflow_are_refused_when_the_graph_is_built(tmp_path):
    four = [{"id": f"n{i}", "compute_s": 1e308} for i in range(4)]  # each finite, their sum is not
    with pytest.raises(GraphError, match=r"sum of \"compute_s\".*too large for a float.*limit"):
        load_graph(_graph_file(tmp_path / "four.json", four))
    # one such op on a slow device (2xK80: speed 0.035) was placed with an infinite step time
    with pytest.raises(GraphError, match=r"sum of \"compute_s\" over all nodes is 1e\+308"):
        CompGraph.build("one", [{"id": "a", "compute_s": 1e308}], [])
    with pytest.raises(GraphError, match="memory"):
        CompGraph.build("m", [{"id": "a", "param_bytes": 6e99}, {"id": "b", "temp_bytes": 6e99}], [])
    with pytest.raises(GraphError, match="edge \"bytes\""):
        CompGraph.build("e", [{"id": "a"}, {"id": "b"}, {"id": "c"}],
                        [{"src": "a", "dst": "b", "bytes": 6e99}, {"src": "a", "dst": "c", "bytes": 6e99,
                                                                   "tensor": 1}])


def test_cli_features_of_huge_graph_is_one_error_line(tmp_path, capsys, monkeypatch):
    path = _graph_file(tmp_path / "four.json", [{"id": f"n{i}", "compute_s": 1e308} for i in range(4)])
    text = _one_error_line(*run_cli(["features", str(path)], capsys, monkeypatch))  # was an OverflowError
    assert "compute_s" in text


@pytest.mark.parametrize(("device", "link", "message"), [
    ({"speed": 1e-200}, {}, "speed"),
    ({"memory_bytes": 1e101}, {}, "memory_bytes"),
    ({"memory_bytes": 6e99}, {}, "sum to"),  # each device fits the limit, the two together do not
    ({}, {"bandwidth_Bps": 1e-101}, "bandwidth_Bps"),
    ({}, {"latency_s": 1e300}, "latency_s"),
])
def test_cluster_numbers_outside_the_finite_range_are_refused(device, link, message):
    doc = _cluster_doc(**device)
    doc["link"].update(link)
    with pytest.raises(ClusterError, match=message):
        Cluster.from_dict(doc)


def test_clusters_built_in_python_are_held_to_the_same_range():
    from devplace.hardware.cluster import Device, Link

    with pytest.raises(ClusterError, match="device #0 speed"):
        Cluster("slow", (Device("a", 1e9, 1e-300),), Link(1e9))
    with pytest.raises(ClusterError, match="link bandwidth_Bps"):
        Cluster("thin", (Device("a", 1e9), Device("b", 1e9)), Link(1e-300))
    with pytest.raises(ClusterError, match=r"link 0 -> 1 latency_s"):
        Cluster("far", (Device("a", 1e9), Device("b", 1e9)), Link(1e9), {(0, 1): Link(1e9, math.inf)})
    assert Cluster("unbounded", (Device("a", math.inf),), Link(1.0)).num_devices == 1  # memory may be inf


def test_the_extremes_inside_the_limits_give_finite_step_times():
    # totals at the limit on the slowest devices and links the limits allow: every figure stays finite
    third = MAX_TOTAL / 3
    nodes = [{"id": n, "compute_s": third, "param_bytes": third / 2, "output_bytes": third / 2} for n in "abc"]
    edges = [{"src": "a", "dst": "b", "bytes": third}, {"src": "b", "dst": "c", "bytes": third}]
    g = CompGraph.build("edge", nodes, edges)
    doc = _cluster_doc(speed=1 / MAX_TOTAL, memory_bytes=MAX_TOTAL / 2)
    doc["link"] = {"bandwidth_Bps": 1 / MAX_TOTAL, "latency_s": MAX_TOTAL}
    c = Cluster.from_dict(doc)
    for devices in ([0, 0, 0], [0, 1, 0], [1, 0, 1]):
        r = simulate(g, c, np.array(devices))
        assert math.isfinite(r.step_time_s) and r.step_time_s > 0
        assert all(math.isfinite(b) for b in r.peak_memory_bytes)
    assert math.isfinite(lower_bound(g, c).value_s)


# ------------------------------------------------------------------------------------ item 6: unbounded input
def test_endless_and_oversized_files_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(MAX_INPUT_ENV, "4096")
    with pytest.raises(FormatError, match="/dev/zero: is not a regular file"):  # endless: refused unread
        read_json("/dev/zero", "devplace.graph/1")
    with pytest.raises(FormatError, match="not a regular file"):
        load_cluster("/dev/zero")
    big = _graph_file(tmp_path / "big.json", [{"id": f"node{i}", "compute_s": 1} for i in range(300)])
    with pytest.raises(FormatError, match=rf"longer than the input limit of 4,096 bytes.*{MAX_INPUT_ENV}"):
        load_graph(big)
    assert load_graph(big, max_bytes=10**6).num_nodes == 300  # the keyword raises the limit ...
    monkeypatch.setenv(MAX_INPUT_ENV, str(10**6))
    assert load_graph(big).num_nodes == 300  # ... and so does the environment variable
    monkeypatch.setenv(MAX_INPUT_ENV, "lots")
    with pytest.raises(FormatError, match=f"{MAX_INPUT_ENV} is 'lots'"):
        load_graph(big)


def test_cli_bound_on_dev_zero_returns_one_error_line(capsys, monkeypatch):
    monkeypatch.setenv(MAX_INPUT_ENV, "65536")  # the default (256 MiB) works too, just with more memory
    text = _one_error_line(*run_cli(["bound", "example", "/dev/zero"], capsys, monkeypatch))
    assert "/dev/zero" in text and "not a regular file" in text


def test_huge_grids_are_refused_before_they_are_made(tmp_path, monkeypatch):
    body = 'graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\nplacers = ["m-topo"]\nseeds = {}\n'
    with pytest.raises(StudyError, match=r"100,000,000 cells, more than the limit of 1,000,000"):
        parse_study(body.format(100_000_000), base_dir=tmp_path)  # was 5 GB of memory before the first cell
    # counted over placers, orders and seeds: 2 orders x 3 seeds + 3 seeds (single ignores the order) = 9
    nine = ('graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\norders = ["topo", "bfs"]\nseeds = 3\n'
            'placers = ["m-topo", "single"]\n')
    with pytest.raises(StudyError, match="9 cells, more than the limit of 8"):
        parse_study(nine, base_dir=tmp_path, max_cells=8)
    spec = parse_study(nine, base_dir=tmp_path)
    assert len(expand(spec)) == 9
    with pytest.raises(StudyError, match="limit of 8"):
        expand(spec, max_cells=8)
    monkeypatch.setenv(MAX_CELLS_ENV, "8")
    with pytest.raises(StudyError, match=MAX_CELLS_ENV):
        parse_study(nine, base_dir=tmp_path)
    monkeypatch.setenv(MAX_CELLS_ENV, "9")
    assert len(expand(parse_study(nine, base_dir=tmp_path))) == 9


# ------------------------------------------------------------------------------------ item 7: study files
def test_study_file_that_is_not_utf8(tmp_path, capsys, monkeypatch):
    p = tmp_path / "bad.toml"
    p.write_bytes(b'name = "caf\xe9"\ngraphs = ["cifar10/0"]\n')
    with pytest.raises(StudyError, match="not UTF-8"):
        load_study(p)
    text = _one_error_line(*run_cli(["study", "run", str(p), "--db", str(tmp_path / "r.sqlite")], capsys,
                                    monkeypatch))
    assert "not UTF-8" in text and not (tmp_path / "r.sqlite").exists()


@pytest.mark.parametrize(("settings", "message"), [
    ('name = "anneal"\nsettings = {steps = "many"}', r"'steps' must be int, got 'many'"),
    ('name = "anneal"\nsettings = {swap_prob = "half"}', r"'swap_prob' must be float"),
    ('name = "anneal"\nsettings = {steps = 1.5}', r"'steps' must be int"),
    ('name = "anneal"\nsettings = {initial_temp = nan}', "finite"),
    ('name = "anneal"\nsettings = {start = "nope"}', "unknown placer 'nope'"),
    ('name = "heft"\nsettings = {insertion = 1}', r"'insertion' must be bool"),
    ('name = "placeto"\nsettings = {sim_model = "fast"}', "sim_model"),
    ('name = "contiguous"\nsettings = {devices = "two"}', r"'devices' must be int, got 'two'"),
    # the values, by the placers' own checks (PlacerSpec.check_settings), not only the types
    ('name = "anneal"\nsettings = {steps = -5}', "anneal: steps must be an integer >= 0 and at most 1,000,000, got -5"),
    ('name = "anneal"\nsettings = {swap_prob = 7}', r"swap_prob must be in \[0, 1\], got 7"),
    ('name = "placeto"\nsettings = {lr = -1}', "placeto: lr must be a number > 0"),
    ('name = "placeto"\nsettings = {encoder = "cnn"}', "unknown encoder 'cnn'"),
    ('name = "seq2seq"\nsettings = {samples = 0}', "seq2seq: samples must be an integer >= 1"),
    ('name = "partition"\nsettings = {imbalance = 0}', r"imbalance=0 must be in \(0, 10\]"),
    ('name = "pipeline"\nsettings = {schedule = "gpipe2"}', "setting 'schedule' must be one of"),
    ('name = "pipeline"\nsettings = {microbatches = 0}', "setting 'microbatches' must be an integer >= 1"),
    ('name = "random"\nsettings = {tries = 0}', "setting 'tries' must be an integer >= 1"),
    ('name = "m-sct"\nsettings = {threshold = 2}', r"setting 'threshold' must be a number in \[0, 1\]"),
    ('name = "ilp"\nsettings = {time_limit_s = 0}', "ilp: time_limit_s=0 must be a number of seconds > 0"),
    ('name = "placeto"\nsettings = {policy = "missing.pt"}', "setting 'policy' is 'missing.pt'.*not a file"),
])
def test_every_placer_setting_is_checked_when_the_study_is_read(tmp_path, settings, message):
    body = f'graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\n[[placers]]\n{settings}\n'
    with pytest.raises(StudyError, match=message):
        parse_study(body, base_dir=tmp_path)


@pytest.mark.parametrize("log", ["../outside.csv", "logs/../../outside.csv", "/tmp/devplace-absolute.csv", "."])
def test_log_paths_that_leave_the_study_folder_are_refused(tmp_path, log):
    body = (f'graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\n[[placers]]\nname = "placeto"\n'
            f'settings = {{episodes = 1, log = "{log}"}}\n')
    with pytest.raises(StudyError, match="outside the study's folder"):
        parse_study(body, base_dir=tmp_path / "study")


def test_log_resolves_in_the_study_folder_with_one_file_per_cell(tmp_path, monkeypatch):
    study_dir, elsewhere = tmp_path / "study", tmp_path / "cwd"
    study_dir.mkdir()
    elsewhere.mkdir()
    save_graph(layered_graph(12, width=3, seed=0), study_dir / "g.json")
    (study_dir / "s.toml").write_text(
        'graphs = ["g.json"]\nclusters = ["3xGPU-placeto"]\nseeds = 2\n[[placers]]\nname = "placeto"\n'
        'settings = {episodes = 2, hidden = 8, rounds = 1, log = "logs/curve.csv"}\n')
    monkeypatch.chdir(elsewhere)
    cells = expand(load_study(study_dir / "s.toml"))
    g, c = load_graph(study_dir / "g.json"), load_cluster("3xGPU-placeto")
    rows = [run_cell(cell, g, c) for cell in cells]
    assert all(r["status"] == "ok" and len(r["curve"]) == 2 for r in rows)
    written = sorted(p.name for p in (study_dir / "logs").iterdir())
    assert written == sorted(f"curve.{cell.key}.csv" for cell in cells) and len(written) == 2
    assert not list(elsewhere.rglob("*"))  # nothing in the working directory
    # the log's folder is not part of the key: the study's folder moved elsewhere keeps its cells
    moved = shutil.copytree(study_dir, tmp_path / "moved", ignore=shutil.ignore_patterns("logs"))
    again = expand(load_study(moved / "s.toml"))
    assert [cell.key for cell in again] == [cell.key for cell in cells]
    assert again[0].cell_log_path().parent == moved / "logs"


def test_policy_resolves_in_the_study_folder(tmp_path, capsys, monkeypatch):
    study_dir, elsewhere = tmp_path / "study", tmp_path / "cwd"
    (study_dir / "policies").mkdir(parents=True)
    elsewhere.mkdir()
    save_graph(layered_graph(12, width=3, seed=0), study_dir / "g.json")
    train = ["train", str(study_dir / "g.json"), "-c", "3xGPU-placeto", "--episodes", "1", "--hidden", "4",
             "--rounds", "1", "-o", str(study_dir / "policies" / "p.pt"), "-q"]
    code, _, err = run_cli(train, capsys, monkeypatch)
    assert code == 0, err
    (study_dir / "s.toml").write_text(
        'graphs = ["g.json"]\nclusters = ["3xGPU-placeto"]\n[[placers]]\nname = "placeto"\n'
        'settings = {episodes = 0, policy = "policies/p.pt"}\n')
    monkeypatch.chdir(elsewhere)  # `policies/p.pt` is not there: it was read from the working directory
    [cell] = expand(load_study(study_dir / "s.toml"))
    assert cell.settings["policy"] == "policies/p.pt"  # the key holds the setting as written
    row = run_cell(cell, load_graph(study_dir / "g.json"), load_cluster("3xGPU-placeto"))
    assert row["status"] == "ok", row["error"]


def test_study_defaults_are_devplace_defaults(tmp_path):
    from devplace.defaults import CANONICAL_ORDER, DEFAULT_SEED, DEFAULT_SIM_MODEL

    spec = parse_study('graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\nplacers = ["m-topo"]\n',
                       base_dir=tmp_path)
    assert (spec.sim_model, spec.orders, spec.seeds) == (DEFAULT_SIM_MODEL, (CANONICAL_ORDER,), (DEFAULT_SEED,))


def _rollback_db(path: Path) -> Path:
    """A devplace results database in rollback-journal mode (as copied or checkpointed), one row."""
    con = connect(path)
    con.execute("INSERT INTO cells (key, study, status) VALUES ('k', 's', 'ok')")
    con.commit()
    con.execute("PRAGMA journal_mode=DELETE")
    con.close()
    return path


def test_reading_a_database_changes_nothing(tmp_path):
    db = _rollback_db(tmp_path / "r.sqlite")
    before = db.read_bytes()
    assert [r["key"] for r in read_cells(db)] == ["k"] and count_rows(db) == 1
    assert db.read_bytes() == before  # it was switched to WAL mode by a report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.sqlite"]


def _file_modes_enforced() -> None:
    """preexec_fn of a child that obeys file modes even as root: drop the capabilities that override them
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER) from its bounding set before it runs."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _devplace(*args: str) -> subprocess.CompletedProcess:
    """`devplace ARGS` in a child process that cannot write read-only files (root included)."""
    return subprocess.run([sys.executable, "-m", "devplace", *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_modes_enforced if os.geteuid() == 0 else None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="drops Linux capabilities for root")
def test_read_only_database_can_be_reported_but_not_written(tmp_path):
    from study_fixture import COLUMNS, fixture_rows

    folder, out = tmp_path / "ro", tmp_path / "report"
    folder.mkdir()
    db = folder / "r.sqlite"
    con = connect(db)
    with con:
        for r in fixture_rows():
            con.execute(f"INSERT INTO cells ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                        tuple(r.get(c) for c in COLUMNS))
    con.execute("PRAGMA journal_mode=DELETE")
    con.close()
    (tmp_path / "s.toml").write_text('graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\nplacers = ["m-topo"]\n')
    before = db.read_bytes()
    db.chmod(0o444)
    folder.chmod(0o555)
    try:
        probe = subprocess.run([sys.executable, "-c", f"open({str(db)!r}, 'ab')"], capture_output=True, text=True,
                               preexec_fn=_file_modes_enforced if os.geteuid() == 0 else None)
        assert "PermissionError" in probe.stderr, "the database is not really read-only for the child"
        report = _devplace("study", "report", str(db), "-o", str(out))
        assert report.returncode == 0, report.stderr  # was "not a devplace study database"
        assert (out / "report.md").is_file()
        ran = _devplace("study", "run", str(tmp_path / "s.toml"), "--db", str(db), "--quiet")
        text = _one_error_line(ran.returncode, ran.stdout, ran.stderr)
        assert "read-only" in text
    finally:
        folder.chmod(0o755)
    assert db.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == ["r.sqlite"]


# ------------------------------------------------------------------------------------ item 8: foreign databases
def _foreign(path: Path, sql: list[str]) -> Path:
    con = sqlite3.connect(str(path))
    with con:
        for stmt in sql:
            con.execute(stmt)
    con.close()
    return path


@pytest.mark.parametrize(("sql", "message"), [
    (["CREATE TABLE cells (id INTEGER PRIMARY KEY, colour TEXT)", "INSERT INTO cells VALUES (1, 'red')"],
     "other columns"),
    (["CREATE TABLE people (name TEXT)"], "no `cells` table"),
    (["CREATE TABLE cells (key TEXT PRIMARY KEY, study TEXT)"], "no schema version"),
    (["CREATE TABLE cells (key TEXT PRIMARY KEY, study TEXT)", "CREATE TABLE meta (name TEXT, value TEXT)",
      "INSERT INTO meta VALUES ('schema_version', '999')"], "schema version '999'"),
])
def test_foreign_databases_are_refused_and_left_unchanged(tmp_path, sql, message):
    db = _foreign(tmp_path / "other.sqlite", sql)
    before = db.read_bytes()
    with pytest.raises(StoreError, match=message):
        connect(db)
    spec = parse_study('graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\nplacers = ["m-topo"]\n',
                       base_dir=tmp_path)
    with pytest.raises(StoreError, match=message):
        run_study(spec, db, retry_failed=True)
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.sqlite"]  # no -wal, -shm or graph cache


@pytest.mark.parametrize("command", ["run", "report"])
def test_refused_wal_database_gets_no_wal_or_shm_file(tmp_path, capsys, monkeypatch, command):
    # a results file of a newer devplace is in WAL mode: opening it read-only to check it made -wal and -shm files
    db = tmp_path / "newer.sqlite"
    con = connect(db)
    con.execute("UPDATE meta SET value = '999' WHERE name = 'schema_version'")
    con.commit()
    con.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newer.sqlite"]
    before = db.read_bytes()
    (tmp_path / "s.toml").write_text('graphs = ["cifar10/0"]\nclusters = ["3xGPU-placeto"]\nplacers = ["m-topo"]\n')
    args = (["study", "run", str(tmp_path / "s.toml"), "--db", str(db)] if command == "run" else
            ["study", "report", str(db), "-o", str(tmp_path / "rep")])
    text = _one_error_line(*run_cli(args, capsys, monkeypatch))
    assert "schema version '999'" in text and db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newer.sqlite", "s.toml"]


def test_cli_foreign_database_is_one_error_line(tmp_path, capsys, monkeypatch):
    db = _foreign(tmp_path / "other.sqlite", ["CREATE TABLE cells (id INTEGER, colour TEXT)"])
    before = db.read_bytes()
    text = _one_error_line(*run_cli(["study", "report", str(db), "-o", str(tmp_path / "rep")], capsys,
                                    monkeypatch))
    assert "not a devplace study database" in text and db.read_bytes() == before


# ------------------------------------------------------------------------------------ item 9: killed drivers
def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in (b"Z", b"X"):
                out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    kids, todo, found = _children(), [pid], set()
    while todo:
        for k in kids.get(todo.pop(), []):
            found.add(k)
            todo.append(k)
    return found


def _alive(pids: set[int]) -> set[int]:
    everyone = {p for ps in _children().values() for p in ps}  # zombies (reaped or not) do not count
    return pids & everyone


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
    except OSError:
        return "?"


def _running_cells(pids: set[int], backend: str) -> int:
    """How many of `pids` are processes running cells: Ray workers, or the local pool's (the fork server's
    children; the fork server and resource tracker are the driver's children)."""
    if backend == "ray":
        return sum(_cmdline(pid).startswith("ray::_ray_call") for pid in pids)
    return max(0, len(pids) - 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("backend", "sig"), [("local", signal.SIGKILL), ("local", signal.SIGTERM),
                                              ("ray", signal.SIGKILL)])
def test_no_process_outlives_a_killed_driver(tmp_path, backend, sig):
    if backend == "ray":
        pytest.importorskip("ray")
    save_graph(layered_graph(40, width=5, seed=0), tmp_path / "g.json")
    (tmp_path / "s.toml").write_text('graphs = ["g.json"]\nclusters = ["3xGPU-placeto"]\nseeds = 4\n'
                                     '[[placers]]\nname = "anneal"\nsettings = {steps = 1000000}\n')
    proc = subprocess.Popen([sys.executable, "-m", "devplace", "study", "run", str(tmp_path / "s.toml"), "--db",
                             str(tmp_path / "r.sqlite"), "--workers", "2", "--backend", backend, "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    helpers: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while _running_cells(helpers, backend) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            helpers = _descendants(proc.pid)
        assert _running_cells(helpers, backend) == 2, f"the study's workers did not start ({helpers})"
        time.sleep(1.0)  # the cells are running
        helpers = _descendants(proc.pid)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(helpers) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: _cmdline(pid) for pid in _alive(helpers)}
        assert not left, f"processes left behind by the killed driver: {left}"
    finally:  # whatever happened, leave nothing running
        for pid in _alive(helpers | _descendants(proc.pid) | {proc.pid}):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


# ------------------------------------------------------------------------------------ item 10: smaller ones
def test_very_long_names_are_refused(tmp_path, capsys, monkeypatch):
    long = "x" * (MAX_NAME_CHARS + 1)
    with pytest.raises(GraphError, match=f"{MAX_NAME_CHARS + 1:,} characters"):
        CompGraph.build(long, [{"id": "a"}], [])
    CompGraph.build("x" * MAX_NAME_CHARS, [{"id": "a"}], [])
    doc = _cluster_doc()
    with pytest.raises(ClusterError, match="cluster name"):
        Cluster.from_dict({**doc, "name": long})
    with pytest.raises(ClusterError, match="device name"):
        Cluster.from_dict({**doc, "devices": [{"name": long, "memory_bytes": 1}]})
    path = _graph_file(tmp_path / "long.json", [{"id": "a", "compute_s": 1.0}], name="y" * 200_000)
    text = _one_error_line(*run_cli(["bound", str(path), "2xK80"], capsys, monkeypatch))  # took 46 s to print
    assert "200,000 characters" in text


class _CountingBackend:
    """Runs cells in this process, counting each run; the first run waits for `release` before its cells."""

    runs: ClassVar[list[str]] = []

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def share(self, obj):
        return obj

    def run(self, fn, tasks):
        self.release.wait(timeout=60)
        for tag, args in tasks:
            type(self).runs.append(tag)
            yield tag, fn(*args)

    def close(self) -> None:
        pass


def test_two_drivers_on_one_database_run_each_cell_once(tmp_path, monkeypatch):
    import devplace.study.backends as backends

    save_graph(layered_graph(12, width=3, seed=0), tmp_path / "g.json")
    spec = parse_study('graphs = ["g.json"]\nclusters = ["3xGPU-placeto"]\nseeds = 3\nplacers = ["m-topo"]\n',
                       base_dir=tmp_path)
    release, started = threading.Event(), threading.Event()
    _CountingBackend.runs = []

    def make_backend(*_args):
        started.set()
        return _CountingBackend(release)

    monkeypatch.setattr(backends, "make_backend", make_backend)
    db = tmp_path / "r.sqlite"
    results: dict[str, object] = {}
    first = threading.Thread(target=lambda: results.update(first=run_study(spec, db)))
    first.start()
    assert started.wait(timeout=60)  # the first driver holds the database and is about to run its cells
    with pytest.raises(StoreError, match="another `devplace study run` is writing"):
        run_study(spec, db)
    release.set()
    first.join(timeout=120)
    assert results["first"].ran == 3 and sorted(_CountingBackend.runs) == sorted(c.key for c in expand(spec))
    assert run_study(spec, db).skipped == 3  # the lock is free again once the first driver is done


def test_anneal_names_itself_when_its_start_finds_no_fit():
    nodes = [{"id": n, "compute_s": 1.0, "param_bytes": 6.0} for n in "abc"]
    g = CompGraph.build("three", nodes, [{"src": "a", "dst": "b", "bytes": 1}, {"src": "b", "dst": "c", "bytes": 1}])
    c = cluster(2, mem=10.0)  # 18 bytes of parameters in 20 bytes of memory, but only one op per device
    with pytest.raises(NoFitError) as info:
        place(g, c, placer="anneal", order="topo", steps=10)
    msg = str(info.value)
    assert msg.startswith("placer \"anneal (start='m-topo')\" found no placement") and "start=" in msg


def test_refused_policy_file_gives_no_advice_to_unpickle_it(tmp_path):
    import torch

    from devplace.placers.rl.checkpoint import PolicyFileError, read_checkpoint

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"format": "devplace.policy/1", "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(PolicyFileError) as info:
        read_checkpoint(tmp_path / "evil.pt")
    msg = str(info.value)
    assert "weights_only" not in msg and "will likely succeed" not in msg and "\n" not in msg
    assert "refused without running any of its code" in msg and "posix.system" in msg
