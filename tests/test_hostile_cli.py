"""Hostile command lines (issue 14): odd paths, odd numbers, empty files, folders as files, symlink loops, huge
and non-finite numbers, duplicated keys, wrong types, usage errors. Each refused command prints one line that
starts with `error:`, exits 2 and changes nothing on disk; each valid one succeeds. Tiny inputs only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_cli
from devplace.files import MAX_INPUT_ENV
from devplace.graph import CompGraph, save_graph
from devplace.graph.compgraph import MAX_NAME_CHARS
from devplace.study.spec import MAX_CELLS_ENV
from devplace.zoo.synthetic import layered_graph
from study_fixture import write_fixture_db


def _graph(nodes: list, edges: list | None = None, name: str = "g") -> str:
    return json.dumps({"format": "devplace.graph/1", "name": name, "nodes": nodes, "edges": edges or []})


def _cluster(devices: list, name: str = "c", **link: object) -> str:
    return json.dumps({"format": "devplace.cluster/1", "name": name, "devices": devices,
                       "link": link or {"bandwidth_Bps": 1e9, "latency_s": 0.0}})


def _placement(assignment: dict) -> str:
    return json.dumps({"format": "devplace.placement/1", "assignment": assignment})


DEV = {"name": "d", "memory_bytes": 1e9}
FILES = {
    "one.json": _graph([{"id": "a", "compute_s": 1.0}]),
    "empty.json": "",
    "blank.json": "  \n",
    "inf.json": _graph([{"id": "a", "compute_s": 1e400}]),  # json reads 1e400 as inf
    "nan.json": '{"format": "devplace.graph/1", "name": "g", "nodes": [{"id": "a", "compute_s": NaN}], "edges": []}',
    "bigint.json": _graph([{"id": "a", "compute_s": 10**400}]),
    "hugeint.json": _graph([{"id": "a", "compute_s": 1}]).replace(": 1}", ": 1" + "0" * 5000 + "}"),
    "dup.json": '{"format": "devplace.graph/1", "name": "g", "name": "h", "nodes": [], "edges": []}',
    "deep.json": "[" * 100_000 + "]" * 100_000,
    "longid.json": _graph([{"id": "x" * (MAX_NAME_CHARS + 1)}]),
    "strc.json": _graph([{"id": "a", "compute_s": "fast"}]),
    "negedge.json": _graph([{"id": "a"}, {"id": "b"}], [{"src": "a", "dst": "b", "bytes": -5}]),
    "nodesdict.json": json.dumps({"format": "devplace.graph/1", "nodes": {"a": 1}, "edges": []}),
    "list.json": "[1, 2]",
    "empty_graph.json": _graph([]),
    "brackets.json": _graph([{"id": "[/]bad", "compute_s": 1.0}, {"id": "[bold]z", "compute_s": 2.0}],
                            [{"src": "[/]bad", "dst": "[bold]z", "bytes": 10}], name="[/]bad"),
    "c_brackets.json": _cluster([{"name": "[/]bad", "memory_bytes": 1e9}, {"name": "[/x]", "memory_bytes": 1e9}],
                                name="[/]bad"),
    "c_negmem.json": _cluster([{"name": "d", "memory_bytes": -1}]),
    "c_zero.json": _cluster([]),
    "c_strmem.json": _cluster([{"name": "d", "memory_bytes": "lots"}]),
    "c_infmem.json": _cluster([{"name": "d", "memory_bytes": 1e400}]),
    "c_devdict.json": json.dumps({"format": "devplace.cluster/1", "name": "c", "devices": {"d": DEV},
                                  "link": {"bandwidth_Bps": 1e9}}),
    "c_linkstr.json": json.dumps({"format": "devplace.cluster/1", "name": "c", "devices": [DEV], "link": "fast"}),
    "c_speed0.json": _cluster([{**DEV, "speed": 0}]),
    "p_float.json": _placement({"a": 1.5}),
    "p_bool.json": _placement({"a": True}),
    "p_extra.json": _placement({"a": 0, "zz": 0}),
    "p_hugeint.json": _placement({"a": 10**30}),
    "curve.csv": "",
    "zero.sqlite": "",
    "deep.toml": "x = " + "[" * 100_000 + "]" * 100_000 + "\n",
    "deep_tables.toml": "x = " + "{a = " * 50_000 + "1" + "}" * 50_000 + "\n",
    "s.toml": 'graphs = ["g12.json"]\nclusters = ["3xGPU-placeto"]\nseeds = 2\nplacers = ["m-topo"]\n',
    # issue 32: settings that scale work, in a study file
    "s_hidden.toml": 'graphs = ["g12.json"]\nclusters = ["2xK80"]\n[[placers]]\nname = "seq2seq"\n'
                     'settings = {hidden = 1000000}\n',
    "s_time.toml": 'graphs = ["g12.json"]\nclusters = ["2xK80"]\n[[placers]]\nname = "anneal"\n'
                   'settings = {time_limit_s = 1e300}\n',
    "deep.jsonl": "[" * 50_000 + "]" * 50_000 + "\n",
    "runs_bad.jsonl": json.dumps({"format": "devplace.run/1", "ratio": 1.0, "devices": [1, 2]}) + "\n",
}


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A working directory holding every file of FILES, a folder, a symlink loop and a dangling symlink."""
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    save_graph(layered_graph(12, width=3, seed=0), tmp_path / "g12.json")
    write_fixture_db(tmp_path / "fx.sqlite")
    (tmp_path / "adir").mkdir()
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to("nowhere")
    monkeypatch.chdir(tmp_path)
    for env in (MAX_INPUT_ENV, MAX_CELLS_ENV):
        monkeypatch.setenv(env, "")  # unset for devplace, and restored after a --max-input-bytes test sets it
    return tmp_path


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` (symlinks not followed) with its size and modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


REFUSED = [
    (["info", "empty.json"], "empty.json:1:1: malformed JSON"),
    (["info", "blank.json"], "malformed JSON"),
    (["info", "adir"], "adir: is a folder; give a regular file"),
    (["info", "loop"], "loop: cannot read: Too many levels of symbolic links"),
    (["info", "dangling"], "dangling: no such file"),
    (["info", "g/[/x].json"], "g/[/x].json: no such file"),  # brackets in a path are not markup
    (["info", "inf.json"], "it must be a finite number"),
    (["info", "nan.json"], "it must be a finite number"),
    (["info", "bigint.json"], "(401 characters); it is too large for a float"),
    (["info", "hugeint.json"], "4300 digits"),
    (["info", "dup.json"], "key 'name' appears twice"),
    (["info", "deep.json"], "malformed JSON"),
    (["info", "longid.json"], f"node #0 id is {MAX_NAME_CHARS + 1:,} characters long"),
    (["info", "strc.json"], "\"compute_s\" must be a number, got 'fast'"),
    (["info", "negedge.json"], "it must be >= 0"),
    (["info", "nodesdict.json"], "\"nodes\" must be a JSON list"),
    (["info", "list.json"], "expected a JSON object"),
    (["bound", "one.json", "c_negmem.json"], "\"memory_bytes\" must be > 0"),
    (["bound", "one.json", "c_zero.json"], "\"devices\" must be a non-empty list"),
    (["bound", "one.json", "c_strmem.json"], "\"memory_bytes\" must be a finite number, got 'lots'"),
    (["bound", "one.json", "c_infmem.json"], "\"memory_bytes\" must be a finite number, got inf"),
    (["bound", "one.json", "c_devdict.json"], "\"devices\" must be a non-empty list"),
    (["bound", "one.json", "c_linkstr.json"], "\"link\" needs \"bandwidth_Bps\""),
    (["bound", "one.json", "c_speed0.json"], "\"speed\" must be > 0"),
    (["bound", "one.json", "adir"], "adir: is a folder"),
    (["bound", "one.json", ""], "neither a cluster preset nor a file"),
    (["simulate", "one.json", "2xK80", "p_float.json"], "device indices are integers"),
    (["simulate", "one.json", "2xK80", "p_bool.json"], "device indices are integers"),
    (["simulate", "one.json", "2xK80", "p_extra.json"], "not in graph 'g'"),
    (["simulate", "one.json", "2xK80", "p_hugeint.json"], "devices 0..1"),
    (["simulate", "one.json", "2xK80", "adir"], "adir: is a folder"),
    (["place", "one.json", "-c", "2xK80", "--seed", "abc"], "Invalid value for '--seed'"),
    (["place", "one.json", "-c", "2xK80", "--seed", "99999999999999999999"], "seed must be an integer from 0"),
    (["place", "one.json", "-c"], "Option '-c' requires an argument"),
    (["place", "one.json", "-c", "2xK80", "--nope"], "No such option: --nope"),
    (["place", "one.json", "-c", "2xK80", "--try", "0"], "must be an integer >= 1, got 0"),
    (["place", "one.json", "-c", "2xK80", "--order", "[/]"], "unknown traversal order '[/]'"),
    (["place", "one.json", "-c", "2xK80", "--placer", "anneal", "--set", "steps=1e400"], "setting 'steps' must be int"),
    (["place", "one.json", "-c", "2xK80", "--placer", "anneal", "--set", "swap_prob=-0.5"], "swap_prob"),
    (["place", "one.json", "-c", "2xK80", "--placer", "placeto", "--policy", "adir"], "adir: is a folder"),
    (["place", "one.json", "-c", "2xK80", "--placer", "placeto", "--policy", "empty.json"],
     "not a devplace policy checkpoint"),
    (["nocmd"], "No such command 'nocmd'"),
    (["--max-input-bytes", "0", "info", "one.json"], "--max-input-bytes must be a whole number of bytes >= 1"),
    (["--max-input-bytes", "-7", "info", "one.json"], "got -7"),
    (["--max-input-bytes", "10", "info", "one.json"], "longer than the input limit of 10 bytes"),
    (["--max-input-bytes", "lots", "info", "one.json"], "Invalid value for '--max-input-bytes'"),
    (["study", "run", "s.toml", "--db", "r.sqlite", "--workers", "0"], "workers must be an integer >= 1"),
    (["study", "run", "s.toml", "--db", "r.sqlite", "--backend", "spark"], "unknown backend 'spark'"),
    (["study", "run", "s.toml", "--db", "r.sqlite", "--address", "x:1"], "--address is for the ray backend"),
    (["study", "run", "s.toml", "--db", "r.sqlite", "--max-cells", "1"], "2 cells, more than the limit of 1"),
    (["study", "run", "s.toml", "--db", "r.sqlite", "--max-cells", "0"], "max_cells must be a whole number"),
    (["study", "run", "adir"], "adir: no such study file"),
    (["study", "run", "deep.toml", "--db", "r.sqlite"], "deep.toml: not valid TOML: arrays or tables nested too"),
    (["study", "run", "deep_tables.toml", "--db", "r.sqlite"], "not valid TOML: arrays or tables nested too"),
    (["study", "run", "s.toml", "--db", "adir"], "adir: not a file"),
    (["study", "run", "one.json", "--db", "r.sqlite"], "one.json: not valid TOML"),
    (["study", "run", "empty.json", "--db", "r.sqlite"], "missing key 'graphs'"),
    (["study", "report", "zero.sqlite", "-o", "rep"], "zero.sqlite has no result rows"),
    (["study", "report", "one.json", "-o", "rep"], "not a devplace study database"),
    (["study", "report", "fx.sqlite", "-o", "one.json"], "-o one.json: is a file, not a folder"),
    (["study", "report", "fx.sqlite", "-o", "loop"], "-o loop: cannot make the folder"),
    (["plot-curve", "curve.csv", "-o", "x.png"], "not a learning curve"),
    (["plot-curve", "curve.csv", "-o", "adir"], "--output adir: is a folder"),
    # output files of training are checked before it: a checkpoint was written, then the log failed
    (["train", "one.json", "-c", "2xK80", "--episodes", "1", "-o", "adir"], "--output adir: is a folder"),
    (["train", "one.json", "-c", "2xK80", "--episodes", "1", "--log", "adir", "-o", "t.pt"], "--log adir: is a"),
    (["place", "one.json", "-c", "2xK80", "--placer", "placeto", "--episodes", "1", "--log", "missing/x.csv"],
     "--log missing/x.csv: folder missing does not exist"),
    # issue 32: every setting that scales work has a limit, in the message (a typo must not run for hours)
    (["place", "one.json", "-c", "2xK80", "--placer", "anneal", "--set", "time_limit_s=1e300"], "at most 86,400"),
    (["place", "one.json", "-c", "2xK80", "--placer", "seq2seq", "--set", "hidden=1000000"], "at most 1,024"),
    (["place", "one.json", "-c", "2xK80", "--placer", "seq2seq", "--set", "samples=100000000"], "at most 1,024"),
    (["place", "one.json", "-c", "2xK80", "--placer", "anneal", "--set", "start=nope"], "unknown placer 'nope'"),
    (["study", "run", "s_hidden.toml", "--db", "r.sqlite"], "placers[0]: seq2seq: hidden must be an integer >= 1"),
    (["study", "run", "s_time.toml", "--db", "r.sqlite"], "time_limit_s must be a number of seconds"),
    (["run", "--model", "mlp", "--threads", "9223372036854775808"], "--threads must be an integer from 1 to"),
    (["profile", "--model", "mlp", "--threads", "9223372036854775808", "-o", "c.json"], "--threads must be"),
    (["place", "one.json", "-c", "2xK80", "--placer", "m-topo", "-o", "x" * 300 + ".json"], "File name too long"),
    (["calibrate", "--runs", "deep.jsonl"], "deep.jsonl:1: not valid JSON (arrays or objects nested too deeply)"),
    (["calibrate", "--runs", "runs_bad.jsonl"], "runs_bad.jsonl:1: field 'devices' of the run record must be"),
]


@pytest.mark.parametrize(("args", "message"), REFUSED, ids=[" ".join(a)[:60] for a, _ in REFUSED])
def test_hostile_command_is_one_error_line_and_changes_nothing(args, message, hostile, capsys, monkeypatch):
    before = _tree(hostile)
    code, out, err = run_cli(args, capsys, monkeypatch)
    text = (out + err).strip("\n")
    assert code == 2 and out == "" and text.startswith("error: ") and "\n" not in text, (code, out, err)
    assert message in text, text
    assert _tree(hostile) == before  # no database, report folder, plot or -wal file was made


VALID = [
    ["info", "brackets.json"],  # a graph, node and kind text with [/] in them is printed as written
    ["bound", "brackets.json", "c_brackets.json"],
    ["place", "brackets.json", "-c", "c_brackets.json", "--placer", "single"],
    ["place", "empty_graph.json", "-c", "2xK80", "--json"],  # nothing to place: step 0, no NaN
    ["--max-input-bytes", "100000", "info", "one.json"],
    ["info", "one.json"],
]


@pytest.mark.parametrize("args", VALID, ids=[" ".join(a) for a in VALID])
def test_odd_but_valid_commands_succeed(args, hostile, capsys, monkeypatch):
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0 and err == "", (code, out, err)
    if "--json" in args:
        def refuse(name: str) -> None:
            raise AssertionError(f"bare {name} in --json output")

        assert json.loads(out, parse_constant=refuse)["speedup_over_single_device"] is None
    if "brackets.json" in args:
        assert "[/]bad" in out


def test_max_input_bytes_flag_raises_the_limit_for_the_command(hostile, capsys, monkeypatch):
    big = hostile / "big.json"
    save_graph(CompGraph.build("big", [{"id": f"node{i}", "compute_s": 1.0} for i in range(200)], []), big)
    size = big.stat().st_size
    monkeypatch.setenv(MAX_INPUT_ENV, str(size - 1))
    code, _, err = run_cli(["info", str(big)], capsys, monkeypatch)
    assert code == 2 and "--max-input-bytes" in err  # the message names the flag
    code, out, err = run_cli(["--max-input-bytes", str(size), "info", str(big)], capsys, monkeypatch)
    assert code == 0 and "200" in out, err
    assert os.environ[MAX_INPUT_ENV] == str(size)  # what the command's worker processes inherit


def test_grid_limit_message_names_the_flag_that_raises_it(hostile, capsys, monkeypatch):
    (hostile / "big.toml").write_text(FILES["s.toml"].replace("seeds = 2", "seeds = 100000000"))
    code, out, err = run_cli(["study", "run", "big.toml", "--db", "r.sqlite"], capsys, monkeypatch)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (out, err)
    assert "100,000,000 cells" in err and "--max-cells N" in err  # the flag, as --max-input-bytes' message does


def test_study_named_like_markup_runs_and_prints_its_name(hostile, capsys, monkeypatch):
    (hostile / "m.toml").write_text('name = "[/]bad"\n' + FILES["s.toml"].replace("seeds = 2", "seeds = 1"))
    code, out, err = run_cli(["study", "run", "m.toml", "--db", "r.sqlite", "--quiet"], capsys, monkeypatch)
    assert code == 0 and out.startswith("[/]bad: 1 cells run"), (out, err)
