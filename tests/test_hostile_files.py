"""Hostile files (issue 24): data files that name code, outputs that would destroy inputs, symlinks, foreign files,
FIFOs and endless devices, huge settings, damaged checkpoints and plans, user code that raises anything. Each case
is one `error:` line and exit 2 (or a valid result), changes no file the command did not create, and imports no
code a data file names. Tiny inputs only."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from devplace.capture.custom import CustomModelError, build_custom_model
from devplace.hardware.cluster import load_cluster
from devplace.hardware.cost import Overheads
from devplace.placers.rl.checkpoint import PolicyFileError, read_checkpoint
from devplace.runtime.plan import build_source
from study_fixture import write_fixture_db

GRAPH = {"format": "devplace.graph/1", "name": "g",
         "nodes": [{"id": "a", "compute_s": 1e-3, "output_bytes": 1000}, {"id": "b", "compute_s": 2e-3}],
         "edges": [{"src": "a", "dst": "b", "bytes": 1000}]}
PLACEMENT = {"format": "devplace.placement/1", "graph": "g", "cluster": "2xK80", "assignment": {"a": 0, "b": 1}}


def _one_line(code: int, out: str, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


def _plan(source: object, settings: object = None) -> dict:
    return {"format": "devplace.plan/1", "settings": {"source": source} if settings is None else settings,
            "cluster": load_cluster("2xK80").to_dict(), "placement": PLACEMENT, "graph": GRAPH}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory with g.json (graph), p.json (its placement) and a package `evil` whose import
    writes `imported` (the proof that a data file ran code) and whose factories raise what their name says."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.json").write_text(json.dumps(GRAPH))
    (tmp_path / "p.json").write_text(json.dumps(PLACEMENT))
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "__init__.py").write_text("")
    (tmp_path / "evil" / "m.py").write_text(
        "import pathlib, sys\npathlib.Path('imported').write_text('ran')\n"
        "def boom():\n    raise ValueError('no weights here')\n"
        "def leave():\n    sys.exit(3)\n"
        "def interrupt():\n    raise KeyboardInterrupt\n")
    (tmp_path / "evil" / "syntax.py").write_text("def f(:\n")
    (tmp_path / "evil" / "raising.py").write_text("raise RuntimeError('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.split(".")[0] in ("evil", "fwd")]:  # this test's copies of them
        del sys.modules[name]


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}


# ---------------------------------------------------------------------------------- data files name no code


@pytest.mark.parametrize("source", [{"custom": "evil.m:boom"}, {"zoo": "evil.m:boom"}, {"custom": "tempfile:mkdtemp"}])
def test_a_plan_naming_code_imports_nothing_without_consent(work, source, capsys, monkeypatch):
    (work / "plan.json").write_text(json.dumps(_plan(source)))
    before = sorted(os.listdir(work))
    text = _one_line(*run_cli(["run", "--plan", "plan.json", "--record", "r.jsonl"], capsys, monkeypatch))
    assert "asks to import and run custom model" in text and "--trust-model" in text
    assert sorted(os.listdir(work)) == before  # nothing imported, no record written
    # another --model than the file's is no consent either
    text = _one_line(*run_cli(["run", "--plan", "plan.json", "--model", "evil.m:leave"], capsys, monkeypatch))
    assert "differs" in text and not (work / "imported").exists()


def test_a_device_map_export_rebuilds_custom_code_only_with_consent(work, capsys, monkeypatch):
    (work / "plan.json").write_text(json.dumps(_plan({"custom": "evil.m:boom"})))
    export = ["export", "plan.json", "--format", "device-map"]
    text = _one_line(*run_cli(export, capsys, monkeypatch))
    assert "asks to import and run custom model" in text and "--trust-model" in text
    text = _one_line(*run_cli([*export, "--model", "evil.m:leave"], capsys, monkeypatch))
    assert "differs" in text and not (work / "imported").exists()
    text = _one_line(*run_cli([*export, "--model", "evil.m:boom"], capsys, monkeypatch))
    assert text == "error: custom model 'evil.m:boom' failed: ValueError: no weights here"
    assert (work / "imported").exists()


def test_consent_imports_the_custom_model_and_its_failure_is_one_line(work, capsys, monkeypatch):
    (work / "plan.json").write_text(json.dumps(_plan({"custom": "evil.m:boom"})))
    text = _one_line(*run_cli(["run", "--plan", "plan.json", "--trust-model"], capsys, monkeypatch))
    assert text == "error: custom model 'evil.m:boom' failed: ValueError: no weights here"
    assert (work / "imported").exists()


def test_the_python_api_takes_the_consent_explicitly(work):
    with pytest.raises(CustomModelError, match="asks to import"):
        build_source({"custom": "evil.m:boom"})
    assert not (work / "imported").exists()
    with pytest.raises(CustomModelError, match="failed: ValueError"):
        build_source({"custom": "evil.m:boom"}, trust_model="evil.m:boom")
    assert (work / "imported").exists()


@pytest.mark.parametrize(("source", "field"), [
    ({"zoo": "mlp", "build_seed": "abc"}, "build_seed"), ({"zoo": "mlp", "build_seed": float("inf")}, "build_seed"),
    ({"zoo": "mlp", "batch": -3}, "batch")])
def test_a_plan_with_bad_source_fields_is_one_line_naming_the_field(work, source, field, capsys, monkeypatch):
    (work / "plan.json").write_text(json.dumps(_plan(source)))
    text = _one_line(*run_cli(["run", "--plan", "plan.json"], capsys, monkeypatch))
    assert "plan.json" in text and repr(field) in text


@pytest.mark.parametrize("fmt", ["json", "pipeline", "device-map"])
def test_a_plan_whose_settings_are_not_an_object_is_one_line(work, fmt, capsys, monkeypatch):
    (work / "plan.json").write_text(json.dumps(_plan(None, settings=[1, 2])))
    text = _one_line(*run_cli(["export", "plan.json", "--format", fmt], capsys, monkeypatch))
    assert "\"settings\" must be a JSON object" in text


# ---------------------------------------------------------------------------------------- user code's errors


@pytest.mark.parametrize(("spec", "message"), [
    ("evil.m:boom", "custom model 'evil.m:boom' failed: ValueError: no weights here"),
    ("evil.m:leave", "custom model 'evil.m:leave' failed: SystemExit: 3"),
    ("evil.m:interrupt", "custom model 'evil.m:interrupt' failed: KeyboardInterrupt"),
    ("evil.syntax:f", "custom model 'evil.syntax:f' failed: SyntaxError: "),
    ("evil.raising:f", "custom model 'evil.raising:f' failed: RuntimeError: at import"),
    (".m:f", "must be written package.module:factory"),
])
def test_whatever_user_code_raises_is_one_error(work, spec, message):
    with pytest.raises(CustomModelError) as info:
        build_custom_model(spec)
    assert message in str(info.value)


def test_a_factory_calling_sys_exit_is_one_line_on_the_command_line(work, capsys, monkeypatch):
    text = _one_line(*run_cli(["capture", "--model", "evil.m:leave", "-o", "out.json"], capsys, monkeypatch))
    assert text == "error: custom model 'evil.m:leave' failed: SystemExit: 3" and not (work / "out.json").exists()


# -------------------------------------------------------------------------------------- never overwrite inputs


@pytest.mark.parametrize("args", [
    ["place", "g.json", "-c", "2xK80", "--placer", "m-etf", "-o", "g.json"],
    ["simulate", "g.json", "2xK80", "p.json", "--trace", "p.json"],
    ["simulate", "g.json", "2xK80", "p.json", "--plot", "g.json"],
    ["place", "g.json", "-c", "2xK80", "--placer", "m-etf", "-o", "link-to-g.json"],
])
def test_an_output_that_is_an_input_is_refused(work, args, capsys, monkeypatch):
    (work / "link-to-g.json").symlink_to("g.json")
    before = _bytes(work)
    text = _one_line(*run_cli(args, capsys, monkeypatch))
    assert "an input of this command" in text and _bytes(work) == before


def test_symlinks_and_foreign_files_are_replaced_only_with_force(work, capsys, monkeypatch):
    (work / "notes.txt").write_text("mine")
    (work / "link.json").symlink_to("notes.txt")
    (work / "dangling.json").symlink_to("nowhere/x.json")
    place = ["place", "g.json", "-c", "2xK80", "--placer", "m-etf", "-o"]
    assert "symbolic link" in _one_line(*run_cli([*place, "link.json"], capsys, monkeypatch))
    assert "symbolic link" in _one_line(*run_cli([*place, "dangling.json"], capsys, monkeypatch))
    assert "not a devplace.placement JSON" in _one_line(*run_cli([*place, "notes.txt"], capsys, monkeypatch))
    assert (work / "notes.txt").read_text() == "mine"
    # --force replaces the link itself, never its target
    assert run_cli([*place, "link.json", "--force"], capsys, monkeypatch)[0] == 0
    assert not (work / "link.json").is_symlink() and (work / "notes.txt").read_text() == "mine"
    # devplace's own output of that kind is rewritten without --force
    assert run_cli([*place, "link.json"], capsys, monkeypatch)[0] == 0
    assert json.loads((work / "link.json").read_text())["format"] == "devplace.placement/1"


def test_an_output_name_ending_in_a_slash_is_a_folder(work, capsys, monkeypatch):
    text = _one_line(*run_cli(["place", "g.json", "-c", "2xK80", "--placer", "m-etf", "-o", "newdir/"], capsys,
                              monkeypatch))
    assert "names a folder" in text and not (work / "newdir").exists()


def test_a_study_report_never_overwrites_its_database(work, capsys, monkeypatch):
    (work / "out").mkdir()
    db = write_fixture_db(work / "out" / "results.csv")
    before = db.read_bytes()
    text = _one_line(*run_cli(["study", "report", str(db), "-o", "out"], capsys, monkeypatch))
    assert "an input of this command" in text and db.read_bytes() == before


def test_run_never_appends_its_record_to_the_plan(work, capsys, monkeypatch):
    (work / "plan.json").write_text(json.dumps(_plan({"zoo": "mlp"})))
    before = (work / "plan.json").read_bytes()
    text = _one_line(*run_cli(["run", "--plan", "plan.json", "--record", "plan.json"], capsys, monkeypatch))
    assert "--record plan.json" in text and (work / "plan.json").read_bytes() == before


def test_a_failed_write_leaves_the_old_file_and_no_temporary(work):
    from devplace.files import output_file

    target = work / "t.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), output_file(target, "--trace") as fh:
        fh.write("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old" and sorted(os.listdir(work)) == sorted(["evil", "g.json", "p.json", "t.json"])


def test_a_name_no_file_can_hold_is_refused_before_anything_is_written(work, capsys, monkeypatch):
    (work / "s.json").write_text(json.dumps(GRAPH).replace('"b"', '"\\ud800"'))  # a lone surrogate, valid JSON
    (work / "sp.json").write_text(json.dumps({**PLACEMENT, "assignment": {"a": 0, "\ud800": 1}}))
    text = _one_line(*run_cli(["simulate", "s.json", "2xK80", "sp.json", "--trace", "t.json"], capsys, monkeypatch))
    assert "surrogate" in text and not (work / "t.json").exists()


# ------------------------------------------------------------------------------------------- no hangs, limits


def test_fifos_and_endless_devices_are_refused_without_reading(work, capsys, monkeypatch):
    os.mkfifo(work / "fifo")  # opened for reading with no writer: a plain open() would block forever
    for args in (["info", "fifo"], ["simulate", "g.json", "2xK80", "fifo"], ["bound", "g.json", "fifo"],
                 ["features", "fifo"], ["train", "fifo", "-c", "2xK80", "-o", "x.pt"],
                 ["capture", "--onnx", "fifo", "-o", "x.json"], ["calibrate", "--runs", "/dev/zero"],
                 ["place", "g.json", "-c", "2xK80", "--placer", "m-etf", "-o", "fifo"]):
        text = _one_line(*run_cli(args, capsys, monkeypatch))
        assert "FIFO" in text or "not a regular file" in text, args


@pytest.mark.parametrize(("args", "limit"), [
    (["place", "g.json", "-c", "2xK80", "--placer", "pipeline", "--microbatches", "100000000"], "1,024"),
    (["train", "g.json", "-c", "2xK80", "--hidden", "200000", "-o", "x.pt"], "4,096"),
    (["train", "g.json", "-c", "2xK80", "--rounds", "100000000", "-o", "x.pt"], "64"),
    (["train", "g.json", "-c", "2xK80", "--episodes", "100000000", "-o", "x.pt"], "100,000"),
    (["run", "--model", "mlp", "--steps", "1000000000"], "100,000"),
    (["run", "--plan", "p.json", "--devices", "meta,meta"], "cannot run training steps"),
    (["--max-input-bytes", str(2**63 - 1), "info", "g.json"], "1,099,511,627,776"),
])
def test_settings_that_scale_work_have_stated_limits(work, args, limit, capsys, monkeypatch):
    assert limit in _one_line(*run_cli(args, capsys, monkeypatch))
    assert not (work / "x.pt").exists()


def test_the_device_count_is_capped(work, capsys, monkeypatch):
    devices = [{"name": f"d{i}", "memory_bytes": 1e9} for i in range(2000)]
    (work / "c.json").write_text(json.dumps({"format": "devplace.cluster/1", "name": "c", "devices": devices,
                                             "link": {"bandwidth_Bps": 1e9, "latency_s": 0}}))
    assert "more than the limit of 1,024" in _one_line(*run_cli(["bound", "g.json", "c.json"], capsys, monkeypatch))


def test_a_study_seed_beyond_64_bits_is_refused_before_the_database_is_made(work, capsys, monkeypatch):
    (work / "s.toml").write_text(f'graphs = ["g.json"]\nclusters = ["2xK80"]\nplacers = ["m-topo"]\n'
                                 f"seeds = [{2**63}]\n")
    text = _one_line(*run_cli(["study", "run", "s.toml", "--db", "s.sqlite"], capsys, monkeypatch))
    assert str(2**63 - 1) in text and not (work / "s.sqlite").exists()


def test_the_input_limit_applies_to_every_reader(work, monkeypatch):
    from devplace.files import MAX_INPUT_ENV, read_limited

    monkeypatch.setenv(MAX_INPUT_ENV, "100")
    (work / "big.csv").write_text("episode,graph\n" + "1,g\n" * 100)
    with pytest.raises(Exception, match="input limit of 100 bytes"):
        read_limited(work / "big.csv")
    from devplace.placers.rl.curve import read_curve

    with pytest.raises(Exception, match="input limit"):
        read_curve(work / "big.csv")


# ----------------------------------------------------------------------------------- stored fields validated


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden": "abc"}, "hidden"), ({"hidden": float("nan")}, "hidden"), ({"hidden": -1}, "hidden"),
    ({"hidden": 10**6}, "hidden"), ({"rounds": 10**8}, "rounds"), ({"state_dict": "weights"}, "state_dict"),
    ({"training": {"episodes_done": "many"}}, "training.episodes_done"), ({"training": [1]}, "training"),
])
def test_a_checkpoint_with_hostile_values_names_the_field(work, change, field):
    doc = {"format": "devplace.policy/1", "placer": "placeto", "encoder": "placeto-gnn", "hidden": 8, "rounds": 2,
           "num_features": 4, "num_devices": 2, "state_dict": {"w": torch.zeros(2)}, **change}
    torch.save(doc, work / "bad.pt")
    with pytest.raises(PolicyFileError, match=f"field '{field}'"):
        read_checkpoint(work / "bad.pt")


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"episode,graph\n1," + b"x" * 200_000 + b"\n"])
def test_plot_curve_on_a_damaged_curve_is_one_line(work, content, capsys, monkeypatch):
    (work / "c.csv").write_bytes(content)
    text = _one_line(*run_cli(["plot-curve", "c.csv", "-o", "c.png"], capsys, monkeypatch))
    assert "c.csv" in text and not (work / "c.png").exists()


# ---------------------------------------------------------------------------------------------- presentation


def test_profile_runs_without_a_terminal(work, capsys, monkeypatch):
    """CI, a pipe or a redirect: no progress bar, and the task gets no progress callback (it crashed)."""
    from devplace import app

    seen = []

    def fake_profile(model, output, *, progress=None, **_):  # the timing itself is test_cost's
        seen.append(progress)
        return _Named("g"), _Table()

    monkeypatch.setattr(app.torch_tasks(), "profile_model", fake_profile)
    code, _out, err = run_cli(["profile", "--model", "mlp", "-o", "c.json"], capsys, monkeypatch)
    assert code == 0 and seen == [None], err


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


class _Table(list):
    skipped: tuple = ()
    overheads = Overheads()


def test_study_database_is_protected_while_reading(work):
    from devplace import files

    files.begin_command()
    try:
        db = write_fixture_db(work / "db.sqlite")
        from devplace.study.store import connect

        connect(db, create=False).close()
        with pytest.raises(files.OutputPathError, match="an input"):
            files.check_output(db, "-o")
    finally:
        files.end_command()
    assert sqlite3.connect(str(db)).execute("SELECT COUNT(*) FROM cells").fetchone()[0] > 0


@pytest.mark.parametrize(("sql", "column"), [
    ("UPDATE cells SET step_time_s = 'fast' WHERE rowid = 1", "step_time_s"),
    ("UPDATE cells SET step_time_s = 9e999 WHERE rowid = 1", "step_time_s"),
    ("UPDATE cells SET features = '{not json' WHERE rowid = 1", "features"),
    # issue 32: valid JSON of the wrong type (AttributeError, JSONDecodeError, ValueError tracebacks before)
    ("UPDATE cells SET features = '[1, 2]' WHERE rowid = 1", "features"),
    ("UPDATE cells SET features = '\"abc\"' WHERE rowid = 1", "features"),
    ("UPDATE cells SET features = '{\"nodes\": \"many\"}' WHERE rowid = 1", "features"),
    ("UPDATE cells SET features = 5 WHERE rowid = 1", "features"),
    ("UPDATE cells SET settings = '[]' WHERE rowid = 1", "settings"),
    ("UPDATE cells SET curve = '{\"a\": 1}' WHERE rowid = 1", "curve"),
    ("UPDATE cells SET status = 'weird' WHERE rowid = 1", "status"),
    ("UPDATE cells SET placer = 7 WHERE rowid = 1", "placer"),
])
def test_a_report_on_an_altered_database_names_row_and_column(work, sql, column, capsys, monkeypatch):
    db = write_fixture_db(work / "db.sqlite")
    with sqlite3.connect(str(db)) as con:
        con.execute(sql)
    text = _one_line(*run_cli(["study", "report", "db.sqlite", "-o", "rep"], capsys, monkeypatch))
    assert "db.sqlite: row" in text and repr(column) in text


def test_a_full_disk_leaves_the_old_output(work, capsys, monkeypatch):
    import errno

    from devplace import files

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    assert run_cli(["simulate", "g.json", "2xK80", "p.json", "--trace", "t.json"], capsys, monkeypatch)[0] == 0
    old = (work / "t.json").read_bytes()
    monkeypatch.setattr(files.os, "fsync", full)
    text = _one_line(*run_cli(["simulate", "g.json", "2xK80", "p.json", "--trace", "t.json"], capsys, monkeypatch))
    assert "No space left on device" in text and (work / "t.json").read_bytes() == old
    assert sorted(p.name for p in work.iterdir() if p.name.startswith(".")) == []  # no temporary file left


def test_standard_output_on_a_full_disk_is_one_line(work):
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # this devplace, installed or not
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "devplace", "info", "g.json", "--json"], stdout=full,
                              stderr=subprocess.PIPE, text=True, cwd=work, env=env)
    assert done.returncode == 2 and done.stderr.strip() == "error: cannot write the output: No space left on device"


@pytest.mark.parametrize("args", [
    ["capture", "--model", "evil.m:boom", "-o", "nowhere/g.json"],
    ["capture", "--model", "evil.m:boom", "-o", "g2.json", "--full", "nowhere/full.json"],
    ["zoo", "family", "cifar10", "-o", "nowhere/g.json"],
    ["run", "--model", "evil.m:boom", "--save-plan", "nowhere/plan.json"],
    ["run", "--model", "evil.m:boom", "--record", "nowhere/runs.jsonl"],
    ["demo", "--out", "g.json"],
])
def test_outputs_are_checked_before_any_work(work, args, capsys, monkeypatch):
    """The factory `evil.m:boom` would fail (and its import leave a mark) if the work started first."""
    text = _one_line(*run_cli(args, capsys, monkeypatch))
    assert ("does not exist" in text or "not a folder" in text) and not (work / "imported").exists()


def test_library_warnings_are_hidden_unless_verbose(monkeypatch):
    import warnings

    from devplace.cli.common import quiet_libraries

    monkeypatch.setenv("PYTHONWARNINGS", "default")  # the test's own setting, restored after it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries(True)
        warnings.warn_explicit("Glyph 7 missing from font", UserWarning, "text.py", 1, module="matplotlib.text")
        warnings.warn_explicit("traced forward differs", UserWarning, "apply.py", 1, module="devplace.runtime.apply")
    assert [str(w.message) for w in seen] == ["traced forward differs"]


def test_a_database_damaged_in_the_middle_is_refused_unchanged(work, capsys, monkeypatch):
    db = write_fixture_db(work / "db.sqlite")
    data = bytearray(db.read_bytes())
    data[len(data) // 2:len(data) // 2 + 3000] = b"\x07" * 3000  # a page in the middle, header and schema intact
    db.write_bytes(data)
    for args in (["study", "report", "db.sqlite", "-o", "rep"],
                 ["study", "run", "s.toml", "--db", "db.sqlite", "--quiet"]):
        (work / "s.toml").write_text('graphs = ["g.json"]\nclusters = ["2xK80"]\nplacers = ["m-topo"]\n')
        text = _one_line(*run_cli(args, capsys, monkeypatch))
        assert "damaged results database" in text and db.read_bytes() == data


def test_the_writer_refuses_text_no_file_can_hold(work):
    from devplace.files import OutputPathError, write_output

    with pytest.raises(OutputPathError, match="lone surrogate"):
        write_output(work / "t.txt", "ok \ud800", "--trace")
    assert not (work / "t.txt").exists()


def test_train_settings_are_checked_before_a_family_is_captured(work, capsys, monkeypatch):
    from devplace import app

    def no_capture(*_a, **_k):
        raise AssertionError("captured before the settings were checked")

    monkeypatch.setattr(app.torch_tasks(), "training_graphs", no_capture)
    args = ["train", "--family", "cifar10", "-c", "2xK80", "--hidden", "200000", "-o", "x.pt"]
    assert "4,096" in _one_line(*run_cli(args, capsys, monkeypatch))


# ------------------------------------------------------------------------------------ issue 32: the residue


def _fwd_package(work: Path) -> None:
    """Package `fwd`: factories whose model's forward or loss (not the factory) exits or is interrupted."""
    (work / "fwd").mkdir()
    (work / "fwd" / "__init__.py").write_text("")
    (work / "fwd" / "m.py").write_text(
        "import sys, torch\nfrom torch import nn\n"
        "class Exits(nn.Module):\n    def __init__(self, how):\n        super().__init__()\n"
        "        self.l, self.how = nn.Linear(4, 4), how\n"
        "    def forward(self, x):\n        if self.how == 'exit':\n            sys.exit(3)\n"
        "        raise KeyboardInterrupt\n"
        "def exits():\n    return Exits('exit'), (torch.randn(2, 4),)\n"
        "def interrupted():\n    return Exits('interrupt'), (torch.randn(2, 4),)\n"
        "def loss_exits():\n    return nn.Linear(4, 4), (torch.randn(2, 4),), lambda out: sys.exit(0)\n"
        "def fine():\n    return nn.Linear(4, 4), (torch.randn(2, 4),)\n")


@pytest.mark.parametrize(("factory", "what"), [("exits", "SystemExit: 3"), ("interrupted", "KeyboardInterrupt"),
                                               ("loss_exits", "SystemExit: 0")])
def test_user_code_that_exits_in_its_forward_or_loss_is_one_line(work, factory, what, capsys, monkeypatch):
    _fwd_package(work)
    text = _one_line(*run_cli(["capture", "--model", f"fwd.m:{factory}", "-o", "out.json"], capsys, monkeypatch))
    assert "the model's code failed during the capture at " in text and "fwd/m.py:" in text and what in text
    assert not (work / "out.json").exists()


def test_a_module_the_command_imported_is_an_input_even_with_force(work):
    from devplace.capture.custom import load_factory
    from devplace.files import OutputPathError, begin_command, check_output, end_command, set_force

    _fwd_package(work)
    begin_command()
    try:
        load_factory("fwd.m:fine")
        set_force(True)
        for name in ("fwd/m.py", "fwd/__init__.py"):
            with pytest.raises(OutputPathError, match="an input of this command"):
                check_output(work / name, "-o")
    finally:
        end_command()


def test_two_outputs_naming_one_file_are_refused(work, capsys, monkeypatch):
    text = _one_line(*run_cli(["capture", "--model", "mlp", "-o", "g2.json", "--full", "./g2.json"], capsys,
                              monkeypatch))
    assert "--full g2.json: is also the file of --output" in text and not (work / "g2.json").exists()


@pytest.mark.parametrize(("placer", "settings", "limit"), [
    ("anneal", {"steps": 10**15}, "1,000,000"), ("anneal", {"time_limit_s": 1e300}, "86,400"),
    ("even-refine", {"max_evals": 10**9}, "1,000,000"), ("random", {"tries": 10**9}, "1,000,000"),
    ("ilp", {"max_nodes": 10**6}, "1,000"), ("ilp", {"time_limit_s": 1e9}, "86,400"),
    ("m-sct", {"max_lp_nodes": 10**9}, "1,000,000"), ("pipeline", {"chunks": 10**6}, "64"),
    ("pipeline", {"microbatches": 10**6}, "1,024"), ("seq2seq", {"episodes": 10**9}, "100,000"),
    ("seq2seq", {"hidden": 4096}, "1,024"), ("seq2seq", {"samples": 10**6}, "1,024"),
    ("placeto", {"parallel": 10**5}, "256"), ("anneal", {"steps": "many"}, "must be int"),
    ("m-topo", {"steps": 3}, "has no setting 'steps'"),
])
def test_every_setting_that_scales_work_has_a_limit_checked_before_work(placer, settings, limit):
    from devplace.placers import get_placer
    from devplace.placers.registry import PlacerError

    with pytest.raises(PlacerError) as info:
        get_placer(placer).validate(settings)
    assert limit in str(info.value)


def test_workers_and_threads_are_at_most_the_cores(monkeypatch):
    from devplace.study import backends
    from devplace.study.backends import BackendError, check_backend

    monkeypatch.setattr(backends, "cpu_cores", lambda: 8)
    check_backend("local", 8)
    with pytest.raises(BackendError, match="at most the 8 CPU cores of this machine, got 64"):
        check_backend("local", 64)
    check_backend("ray", 64, address="head:6379")  # a Ray cluster's workers are its own


def test_a_plans_placer_settings_are_checked_as_set_would_be(work, capsys, monkeypatch):
    settings = {"placer": "anneal", "placer_settings": [1, 2]}
    (work / "plan.json").write_text(json.dumps(_plan(None, settings=settings)))
    text = _one_line(*run_cli(["export", "plan.json"], capsys, monkeypatch))
    assert "plan.json: settings.placer_settings must be a JSON object" in text
    settings["placer_settings"] = {"steps": 10**15}
    (work / "plan.json").write_text(json.dumps(_plan(None, settings=settings)))
    text = _one_line(*run_cli(["export", "plan.json"], capsys, monkeypatch))
    assert "settings.placer_settings: anneal: steps must be an integer >= 0 and at most 1,000,000" in text
    settings.update(placer_settings={}, seed="abc")
    (work / "plan.json").write_text(json.dumps(_plan(None, settings=settings)))
    assert "settings.seed" in _one_line(*run_cli(["export", "plan.json"], capsys, monkeypatch))


def test_export_names_one_device_per_device(work, capsys, monkeypatch):
    (work / "plan.json").write_text(json.dumps(_plan(None, settings={})))
    text = _one_line(*run_cli(["export", "plan.json", "--devices", "cuda:0"], capsys, monkeypatch))
    assert "--devices names 1 device(s), but the placement uses 2 logical devices" in text
    code, out, err = run_cli(["export", "plan.json", "--devices", "cuda:0,cuda:1"], capsys, monkeypatch)
    assert code == 0 and "cuda:1" in out, err


def test_a_pipeline_source_edited_to_another_model_is_refused_before_it_is_built(work):
    from devplace.errors import FormatError
    from devplace.runtime.export import ExportError, read_pipeline

    source = {"zoo": "mobilenet_v3_large", "batch": 1, "seq_len": None, "build_seed": 0}
    with pytest.raises(FormatError, match="a model of 5,483,032 parameters, but the file was made for a model of 7"):
        build_source(source, params=7)  # built on the meta device only: no memory, no weights
    module, _, _ = build_source(source, params=5_483_032)
    assert sum(p.numel() for p in module.parameters()) == 5_483_032
    doc = {"format": "devplace.pipeline/2", "split_points": [], "stage_devices": [0],
           "schedule": {"kind": "1f1b", "microbatches": 1}, "source": source, "source_params": "many"}
    with pytest.raises(ExportError, match="source_params must be the model's parameter count"):
        read_pipeline(doc)


def test_every_json_devplace_writes_is_strict(work):
    """The report's validation.json held a bare NaN on any small study (a leave-one-family-out fold of one
    family); json_text writes null for every non-finite number, as --json does."""
    from devplace.files import json_text
    from devplace.study.report import write_report
    from study_fixture import fixture_rows

    assert json_text({"a": [math.nan, math.inf, 1.5]}) == '{"a": [null, null, 1.5]}'
    rows = [r for r in fixture_rows() if r["graph"] in ("fa/0", "fa/1")]  # one family
    write_report(write_fixture_db(work / "db.sqlite", rows), work / "rep")

    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in validation.json")

    assert json.loads((work / "rep" / "validation.json").read_text(), parse_constant=refuse)


def test_a_report_whose_placer_failed_everywhere_draws_without_library_warnings(work):
    from devplace.study.report import write_report
    from study_fixture import fixture_rows

    rows = fixture_rows()
    for r in rows:
        if r["placer"] == "greedy":
            r.update(status="failed", step_time_s=None, feasible=None, error="NoFitError: nothing fits")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        write_report(write_fixture_db(work / "db.sqlite", rows), work / "rep")
    assert [str(w.message) for w in seen] == []


def test_the_simulators_channel_scratch_is_clean_between_runs():
    """One DevplaceModel keeps its channels (devices x devices) between runs and resets the ones a run used:
    a run after another gives what a fresh model gives."""
    import numpy as np

    from devplace.sim.devplace_model import DevplaceModel
    from devplace.zoo.synthetic import layered_graph

    g, c = layered_graph(30, width=4, seed=1), load_cluster("4xV100-16GB")
    rng = np.random.default_rng(0)
    first, second = (rng.integers(0, 4, g.num_nodes) for _ in range(2))
    model = DevplaceModel(g, c)
    model.run(first)
    again, fresh = model.run(second), DevplaceModel(g, c).run(second)
    assert again.step_time_s == fresh.step_time_s and np.array_equal(again.start_s, fresh.start_s)
    assert not model._chan_free.any() and (model._chan_last == -1).all()


def test_auto_leaves_greedy_out_on_a_dense_graph_and_says_so(monkeypatch):
    import devplace.placers.search as search
    from devplace.graph.compgraph import CompGraph

    nodes = [{"id": f"n{i}", "compute_s": 1e-3, "output_bytes": 1000} for i in range(12)]
    edges = [{"src": f"n{i}", "dst": f"n{j}", "bytes": 1000} for i in range(12) for j in range(i + 1, 12)]
    g = CompGraph.build("dense", nodes, edges)
    monkeypatch.setattr(search, "AUTO_QUADRATIC_WORK", 12 * (12 + 66) - 1)
    assert "66 edges" in search.auto_skipped(g, devices=4)["greedy"]
    monkeypatch.setattr(search, "AUTO_QUADRATIC_WORK", 12 * (12 + 66))
    assert search.auto_skipped(g, devices=4) == {}
    # greedy simulates the graph once per node and device: a small graph on a huge cluster is left out too
    monkeypatch.setattr(search, "AUTO_QUADRATIC_SIMULATIONS", 12 * 1024 - 1)
    assert "12 nodes on 1,024 devices" in search.auto_skipped(g, devices=1024)["greedy"]
    assert search.auto_skipped(g, devices=1023) == {}
    monkeypatch.setattr(search, "AUTO_SIMULATED_EDGES", 66 * 100)
    settings, note = search.auto_settings("even-refine", None, g)
    assert settings == {"max_evals": 100} and "66 edges" in note
