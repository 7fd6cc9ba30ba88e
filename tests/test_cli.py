"""The `devplace` command: real runs in-process, JSON output, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import graph
from conftest import run_cli as run
from devplace import save_graph, save_placement
from devplace.graph import Placement
from devplace.hardware import save_cluster
from devplace.hardware.cluster import Cluster, Device, Link


@pytest.fixture
def files(tmp_path):
    g = graph([("a", 1.0), ("b", 2.0), ("c", 0.5)], [("a", "b", 10), ("a", "c", 10)])
    c = Cluster("two", (Device("g0", 100.0), Device("g1", 100.0)), Link(10.0, 0.5))
    paths = {"graph": tmp_path / "g.json", "cluster": tmp_path / "c.json", "placement": tmp_path / "p.json"}
    save_graph(g, paths["graph"])
    save_cluster(c, paths["cluster"])
    save_placement(Placement({"a": 0, "b": 1, "c": 0}), paths["placement"])
    return {k: str(v) for k, v in paths.items()}


def test_simulate_json(files, capsys, monkeypatch):
    code, out, _ = run(["simulate", files["graph"], files["cluster"], files["placement"], "--json", "--per-op"],
                       capsys, monkeypatch)
    assert code == 0
    doc = json.loads(out)
    assert doc["step_time_s"] == 4.5  # a [0,1], transfer [1,2.5], b [2.5,4.5]; c [1,1.5]
    assert doc["feasible"] is True
    assert doc["peak_memory_bytes"] == [0.0, 10.0]
    assert doc["comm_bytes"] == 10.0
    assert doc["device_busy_s"] == [1.5, 2.0]
    assert doc["ops"]["b"] == {"device": 1, "start_s": 2.5, "finish_s": 4.5}
    assert doc["lower_bound_s"] == 3.0


def test_simulate_table_trace_and_plot(files, capsys, monkeypatch, tmp_path):
    trace, plot = tmp_path / "t.json", tmp_path / "t.png"
    code, out, _ = run(["simulate", files["graph"], files["cluster"], files["placement"], "--trace", str(trace),
                        "--plot", str(plot)], capsys, monkeypatch)
    assert code == 0
    assert "step time" in out and "feasible" in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["placeto-sim", "placeto"])
def test_simulate_placeto_sim_model_and_its_old_name(files, capsys, monkeypatch, name):
    """The Placeto paper's simulator is `placeto-sim` (not the placer); `placeto` stays an alias of it."""
    code, out, _ = run(["simulate", files["graph"], files["cluster"], files["placement"], "--model", name,
                        "--json"], capsys, monkeypatch)
    assert code == 0
    doc = json.loads(out)
    assert doc["model"] == "placeto-sim"
    code, out, _ = run(["simulate", files["graph"], files["cluster"], files["placement"], "--json"], capsys,
                       monkeypatch)
    assert json.loads(out)["model"] == "devplace" and json.loads(out)["step_time_s"] != doc["step_time_s"]


def test_bound_info_clusters(files, capsys, monkeypatch):
    code, out, _ = run(["bound", files["graph"], files["cluster"], "--json"], capsys, monkeypatch)
    assert code == 0
    doc = json.loads(out)
    # no kinds: every op may be micro-batched, so any schedule leaves only the work (3.5 s over two devices)
    assert doc["lower_bound_s"] == 1.75 and doc["limited_by"] == "total work"
    assert doc["unpipelined"]["lower_bound_s"] == 3.0 and doc["unpipelined"]["critical_path"] == ["a", "b"]
    code, out, _ = run(["info", files["graph"], "--json"], capsys, monkeypatch)
    assert code == 0
    info = json.loads(out)
    assert (info["nodes"], info["edges"], info["depth_hops"], info["total_compute_s"]) == (3, 2, 1, 3.5)
    code, out, _ = run(["clusters", "--json"], capsys, monkeypatch)
    assert code == 0
    names = [c["name"] for c in json.loads(out)]
    assert "4xV100-16GB" in names and "2xK80" in names
    code, out, _ = run(["clusters"], capsys, monkeypatch)
    assert code == 0 and "8xV100-32GB-NVLink" in out


def test_demo_captures_and_places_a_zoo_model(capsys, monkeypatch, tmp_path):
    # the README's demo is llama-1b (about a minute); bert-base runs the same path in less
    code, out, err = run(["demo", "--model", "bert-base", "--out", str(tmp_path)], capsys, monkeypatch)
    assert code == 0, err
    text = " ".join(out.split())
    for row in ("single gpu0", "contiguous", "even split", "pipeline placer", "devplace (default)",
                "work / 4 devices", "even-stage estimate 1f1b"):
        assert row in text
    assert re.search(r"pipeline placer \S 1f1b M=8", text)  # the pipeline placer's row at the demo's schedule
    assert "placer auto ->" in text  # the answer is the default search's (issue 31: parallel plans among them)
    placement = json.loads((tmp_path / "bert-base.placement.json").read_text())
    groups = int(re.search(r"captured bert-base-b8\S*: \d+ ops, colocated into (\d+) groups", text).group(1))
    # every op of the answer's graph as run (a micro-batch captured at its own size here), not the groups
    assert placement["graph"].startswith("bert-base-b") and len(placement["assignment"]) > groups
    assert json.loads((tmp_path / "bert-base-trace.json").read_text())["traceEvents"]
    assert (tmp_path / "bert-base-timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_capture_place_model_zoo_commands(capsys, monkeypatch, tmp_path):
    g = tmp_path / "g.json"
    code, out, _ = run(["capture", "--model", "resnet50", "--batch", "2", "--max-nodes", "50", "-o", str(g)],
                       capsys, monkeypatch)
    assert code == 0 and "1751 ops -> 50 groups" in out
    doc = json.loads(g.read_text())
    assert doc["format"] == "devplace.graph/1" and len(doc["nodes"]) == 50
    code, out, _ = run(["place", str(g), "-c", "4xV100-16GB", "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["feasible"]
    code, out, _ = run(["place", "--model", "resnet50", "--batch", "2", "--max-nodes", "40", "-c", "2xK80",
                        "--placer", "greedy", "--json"], capsys, monkeypatch)
    doc = json.loads(out)
    assert code == 0 and doc["placed_groups"] == 40 and len(doc["assignment"]) == 1751
    # the placement as autograd runs it: every backward/optimizer op with its forward op
    assert doc["as_run"]["ops_moved"] >= 0 and doc["as_run"]["step_time_s"] > 0
    if doc["as_run"]["ops_moved"] == 0:
        assert doc["as_run"]["step_time_s"] == doc["step_time_s"]
    code, out, _ = run(["zoo", "list", "--json"], capsys, monkeypatch)
    assert "gpt2-xl" in json.loads(out)["models"]
    code, out, err = run(["place", "-c", "2xK80"], capsys, monkeypatch)
    assert code == 2 and "--model" in err
    code, out, err = run(["capture", "--model", "resnet-9000", "-o", str(g)], capsys, monkeypatch)
    assert code == 2 and "resnet50" in err


def test_place_json_and_example_graph(capsys, monkeypatch, tmp_path):
    out_file = tmp_path / "p.json"
    code, out, _ = run(["place", "example", "-c", "4xV100-16GB", "--placer", "greedy", "--order", "bfs", "--json",
                        "-o", str(out_file)], capsys, monkeypatch)
    assert code == 0
    doc = json.loads(out)
    assert doc["feasible"] and doc["order"] == "bfs" and doc["placer"] == "greedy"
    assert doc["step_over_lower_bound"] >= 1.0
    assert doc["best_single_device"]["fits"] is False  # the example is too big for one 16 GB GPU
    assert doc["speedup_over_single_device"] is None and doc["best_single_device"]["needs_bytes"] > 16e9
    assert doc["even_split"]["fits"] is True and doc["even_split"]["speedup"] > 0
    assert json.loads(out_file.read_text())["assignment"] == doc["assignment"]
    code, out, err = run(["place", "example", "-c", "2xK80", "--placer", "m-topo"], capsys, monkeypatch)
    assert code == 2 and "needs about" in err and len(err.strip().splitlines()) == 1
    code, out, err = run(["place", "example", "-c", "4xV100-16GB", "--set", "bogus"], capsys, monkeypatch)
    assert code == 2 and "key=value" in err
    code, out, _ = run(["placers", "--json"], capsys, monkeypatch)
    specs = json.loads(out)
    assert specs["greedy"]["uses_order"] is True and specs["heft"]["uses_order"] is False
    assert specs["greedy"]["cheap"] is True and specs["placeto"]["cheap"] is False
    assert specs["placeto"]["settings"]["encoder"] == "'placeto-gnn'"


@pytest.mark.parametrize(("args", "message"), [
    (["info", "missing.json"], "no such file"),
    (["simulate", "{graph}", "nonexistent-preset", "{placement}"], "neither a cluster preset nor a file"),
    (["simulate", "{graph}", "{cluster}", "{placement}", "--model", "tf"], "unknown simulation model"),
    (["simulate", "{graph}", "{cluster}", "{bad_placement}"], "devices 0..1"),
    (["info", "{cyclic}"], "has a cycle: "),
    (["info", "{malformed}"], ":3:"),
    (["info", "{future}"], "unknown version"),
])
def test_user_errors_print_one_line_and_exit_2(args, message, files, capsys, monkeypatch, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "devplace.placement/1", "assignment": {"a": 0, "b": 5, "c": 0}}))
    cyclic = tmp_path / "cyc.json"
    cyclic.write_text(json.dumps({"format": "devplace.graph/1", "nodes": [{"id": "x"}, {"id": "y"}],
                                  "edges": [{"src": "x", "dst": "y"}, {"src": "y", "dst": "x"}]}))
    malformed = tmp_path / "mal.json"
    malformed.write_text('{"format": "devplace.graph/1",\n "nodes": [],\n "edges": [,]}\n')
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"format": "devplace.graph/9", "nodes": [], "edges": []}))
    paths = {**files, "bad_placement": str(bad), "cyclic": str(cyclic), "malformed": str(malformed),
             "future": str(future)}
    code, out, err = run([a.format(**paths) for a in args], capsys, monkeypatch)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in err


def test_order_orders_and_features(files, capsys, monkeypatch):
    code, out, _ = run(["order", files["graph"], "--order", "reversed-topo"], capsys, monkeypatch)
    assert code == 0 and out.split() == ["c", "b", "a"]
    code, out, _ = run(["order", files["graph"], "--order", "dfs-preorder", "--json"], capsys, monkeypatch)
    assert json.loads(out)["nodes"] == ["a", "b", "c"]
    code, out, err = run(["order", files["graph"], "--order", "sideways"], capsys, monkeypatch)
    assert code == 2 and "valid orders: topo" in err
    code, out, _ = run(["orders", "--json"], capsys, monkeypatch)
    assert json.loads(out)["topo"]["topological"] is True
    code, out, _ = run(["features", files["graph"], "--json"], capsys, monkeypatch)
    feats = json.loads(out)
    assert (feats["nodes"], feats["depth"], feats["width"], feats["comm_to_compute"]) == (3, 1, 2, None)
    code, out, _ = run(["features", files["graph"], "--cluster", files["cluster"], "--json"], capsys, monkeypatch)
    # two 10-byte edges at 10 B/s + 0.5 s latency each = 3 s of transfers over 3.5 s of compute
    assert json.loads(out)["comm_to_compute"] == pytest.approx(3.0 / 3.5)


def test_place_learned_placer_flags(files, tmp_path, capsys, monkeypatch):
    log = tmp_path / "run.csv"
    code, out, err = run(["place", files["graph"], "-c", files["cluster"], "--placer", "placeto", "--episodes", "2",
                          "--log", str(log), "--set", "rounds=1", "--set", "hidden=4", "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["settings"]["episodes"] == 2
    assert len(log.read_text().strip().splitlines()) >= 3  # header + one line per training episode
    code, _, err = run(["place", files["graph"], "-c", files["cluster"], "--placer", "placeto", "--episodes", "2",
                        "--set", "episodes=3"], capsys, monkeypatch)
    assert code == 2 and "--episodes and --set episodes" in err
    code, _, err = run(["place", files["graph"], "-c", files["cluster"], "--placer", "m-etf", "--policy", "p.pt"],
                       capsys, monkeypatch)
    assert code == 2 and "no setting 'policy'" in err


@pytest.mark.parametrize("encoder", ["placeto-gnn", "placeto"])
def test_train_names_the_placeto_encoder_placeto_gnn(files, tmp_path, capsys, monkeypatch, encoder):
    """The Placeto paper's encoder is `placeto-gnn` (the old `placeto` stays an alias); both train one policy."""
    out_pt = tmp_path / "p.pt"
    code, out, err = run(["train", files["graph"], "-c", files["cluster"], "--episodes", "1", "--hidden", "4",
                          "--rounds", "1", "--encoder", encoder, "--sim-model", "placeto-sim", "-o", str(out_pt),
                          "-q"], capsys, monkeypatch)
    assert code == 0, err
    assert out_pt.is_file() and "trained placeto" in out
    code, _, err = run(["train", files["graph"], "-c", files["cluster"], "--episodes", "1", "--encoder", "gnn",
                        "-o", str(out_pt), "-q"], capsys, monkeypatch)
    assert code == 2 and "unknown encoder" in err


# ------------------------------------------------------------------ issue 14: hostile input, one line each
def _graph_doc(nodes: list[str], edges: list[tuple[str, str]]) -> str:
    return json.dumps({"format": "devplace.graph/1", "name": "h", "nodes": [{"id": n, "compute_s": 1.0} for n in nodes],
                       "edges": [{"src": a, "dst": b, "bytes": 1} for a, b in edges]})


def _one_error_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "\x1b" not in err  # no terminal escape code reaches the terminal
    return lines[0]


def test_user_text_in_errors_is_never_markup_and_stays_one_line(tmp_json, capsys, monkeypatch):
    cyc = tmp_json(_graph_doc(["[/]", "[bold]z", "x\n\x1b[31my"], [("[/]", "[bold]z"), ("[bold]z", "x\n\x1b[31my"),
                                                                  ("x\n\x1b[31my", "[/]")]))
    line = _one_error_line(*run(["info", str(cyc)], capsys, monkeypatch)[::2])
    assert "[/]" in line and "[bold]z" in line and "\\n" in line and "\\x1b" in line
    line = _one_error_line(*run(["bound", "example", "[/red]"], capsys, monkeypatch)[::2])
    assert "[/red]" in line
    line = _one_error_line(*run(["place", "example", "-c", "4xV100-16GB", "--placer", "[/]"], capsys,
                                monkeypatch)[::2])
    assert "'[/]'" in line


@pytest.mark.parametrize("command", [["place", "G", "-c", "2xK80", "--placer", "m-etf", "--order", "topo"],
                                     ["order", "G"], ["info", "G"], ["bound", "G", "2xK80"]])
def test_names_in_successful_output_cannot_drive_the_terminal(command, tmp_json, capsys, monkeypatch):
    doc = json.loads(_graph_doc(["a\x1b[2J", "b\x07"], [("a\x1b[2J", "b\x07")]))
    path = tmp_json(json.dumps({**doc, "name": "g\x1b[31m"}))
    code, out, err = run([str(path) if a == "G" else a for a in command], capsys, monkeypatch)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\\x1b" in out  # written as escapes, not sent


def test_errors_leave_stdout_empty(capsys, monkeypatch):
    code, out, err = run(["place", "example", "-c", "4xV100-16GB", "--placer", "nope"], capsys, monkeypatch)
    assert code == 2 and out == "", (out, err)


@pytest.mark.parametrize("what", ["-o", "--trace", "--plot"])
@pytest.mark.parametrize("where", ["folder", "folder/", "missing/dir/f.json", "/proc/version"])
def test_unwritable_output_paths_are_refused_before_any_work(what, where, files, tmp_path, capsys, monkeypatch):
    if where == "/proc/version" and not Path(where).is_file():
        pytest.skip("no /proc/version here")
    (tmp_path / "folder").mkdir()
    path = where if where.startswith("/") else str(tmp_path / where)
    code, out, err = run(["place", files["graph"], "-c", files["cluster"], "--placer", "single", what, path],
                         capsys, monkeypatch)
    line = _one_error_line(code, err)
    assert path.rstrip("/") in line and out == ""
    assert not (tmp_path / "missing").exists()  # nothing was created
    if what != "-o":
        code, _, err = run(["simulate", files["graph"], files["cluster"], files["placement"], what, path], capsys,
                           monkeypatch)
        _one_error_line(code, err)


@pytest.mark.parametrize("args", [
    ["place", "example", "-c", "4xV100-16GB", "--placer", "random"],
    ["order", "example", "--order", "random"],
    ["train", "example", "-c", "4xV100-16GB", "--episodes", "1"],
    ["run", "--model", "gpt2"],
])
def test_every_command_checks_seeds_alike(args, capsys, monkeypatch):
    for seed in ("-1", str(2**63)):
        line = _one_error_line(*run([*args, "--seed", seed], capsys, monkeypatch)[::2])
        assert "seed must be an integer from 0 to" in line


def test_json_never_prints_nan(tmp_json, capsys, monkeypatch):
    zero = tmp_json(json.dumps({"format": "devplace.graph/1", "name": "z",
                                "nodes": [{"id": "a", "compute_s": 0.0}, {"id": "b", "compute_s": 0.0}],
                                "edges": []}))
    code, out, err = run(["place", str(zero), "-c", "4xV100-16GB", "--placer", "single", "--json"], capsys,
                         monkeypatch)
    assert code == 0, err

    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in --json output")

    doc = json.loads(out, parse_constant=refuse)
    assert doc["step_time_s"] == 0.0 and doc["speedup_over_single_device"] is None


def test_simulate_warns_when_the_placement_was_made_for_another_graph(files, tmp_path, capsys, monkeypatch):
    other = tmp_path / "other.json"
    save_placement(Placement({"a": 0, "b": 1, "c": 0}, graph="not-t", cluster="two"), other)
    code, out, err = run(["simulate", files["graph"], files["cluster"], str(other), "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["step_time_s"] == 4.5
    assert err.startswith("warning: ") and "'not-t'" in err and "'t'" in err and err.count("\n") == 1
    code, _, err = run(["simulate", files["graph"], files["cluster"], files["placement"]], capsys, monkeypatch)
    assert code == 0 and err == ""


# ------------------------------------------------------------------ issue 12: the pipeline placer's flags
@pytest.fixture
def layered(tmp_path):
    """A training step of 4 tied layers (forward 1 s, backward 2 s) and a 2-device cluster."""
    nodes = [{"id": f"l{i}", "kind": "forward", "compute_s": 1.0, "output_bytes": 8} for i in range(4)]
    nodes += [{"id": f"g{i}", "kind": "backward", "group": f"l{i}", "compute_s": 2.0} for i in reversed(range(4))]
    edges = [{"src": f"l{i}", "dst": f"l{i + 1}", "bytes": 8} for i in range(3)]
    edges += [{"src": f"l{i}", "dst": f"g{i}", "bytes": 8} for i in range(4)]
    edges += [{"src": f"g{i + 1}", "dst": f"g{i}", "bytes": 8} for i in range(3)]
    g = tmp_path / "layers.json"
    g.write_text(json.dumps({"format": "devplace.graph/1", "name": "layers", "nodes": nodes, "edges": edges}))
    c = tmp_path / "c.json"
    save_cluster(Cluster("two", (Device("g0", 1e6), Device("g1", 1e6)), Link(1e9, 0.0)), c)
    return str(g), str(c)


def test_place_pipeline_flags_on_a_graph_file_and_simulate_under_its_schedule(layered, tmp_path, capsys,
                                                                              monkeypatch):
    g, c = layered
    out_p = tmp_path / "p.json"
    code, out, err = run(["place", g, "-c", c, "--placer", "pipeline", "--schedule", "gpipe", "--microbatches", "4",
                          "-o", str(out_p), "--json"], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schedule"]["kind"] == "gpipe" and doc["schedule"]["microbatches"] == 4
    # two stages of 2 layers: (M + p - 1) slots of 2 * (1 + 2) / 4 s
    assert doc["step_time_s"] == pytest.approx(5 * 6.0 / 4)
    assert doc["lower_bound_s"] == pytest.approx(12.0 / 2)  # the work per device; the whole-batch path is 12 s
    assert doc["step_time_s"] >= doc["lower_bound_s"]
    code, out, err = run(["simulate", g, c, str(out_p), "--json"], capsys, monkeypatch)
    assert code == 0, err
    sim = json.loads(out)
    assert (sim["step_time_s"], sim["schedule"], sim["lower_bound_s"]) == (doc["step_time_s"], doc["schedule"],
                                                                         doc["lower_bound_s"])
    code, out, err = run(["simulate", g, c, str(out_p)], capsys, monkeypatch)
    assert "schedule gpipe: M = 4 micro-batches, 2 stages on 2 devices; bubble 20.0%" in " ".join(out.split())
    code, _, err = run(["simulate", g, c, str(out_p), "--model", "placeto-sim"], capsys, monkeypatch)
    assert _one_error_line(code, err).endswith("use --model devplace")


def test_bound_is_never_above_a_reported_pipelined_step_and_says_what_it_bounds(layered, capsys, monkeypatch):
    """The pipelined step (7.5 s) is below the bound without micro-batches (12 s): `bound` leads with the bound
    for any schedule, names the scope of each, and bounds one schedule when asked."""
    g, c = layered
    code, out, err = run(["place", g, "-c", c, "--placer", "pipeline", "--schedule", "gpipe", "--microbatches", "4",
                          "--json"], capsys, monkeypatch)
    assert code == 0, err
    step = json.loads(out)["step_time_s"]
    code, out, err = run(["bound", g, c, "--json"], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["lower_bound_s"] <= step < doc["unpipelined"]["lower_bound_s"] == 12.0
    assert "any micro-batch schedule" in doc["scope"] and "one batch per step" in doc["unpipelined"]["scope"]
    code, out, err = run(["bound", g, c, "--json", "--schedule", "gpipe", "--microbatches", "4"], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["lower_bound_s"] == pytest.approx(6.0) and "gpipe M=4" in doc["scope"] and "unpipelined" not in doc
    code, _, err = run(["bound", g, c, "--schedule", "gpipe"], capsys, monkeypatch)
    assert code == 2 and "--microbatches" in err and err.count("\n") == 1
    code, out, _ = run(["bound", g, c], capsys, monkeypatch)
    assert "valid for every placement, run as one batch or under any micro-batch schedule" in " ".join(out.split())


@pytest.mark.parametrize("flags,message", [
    (["--schedule", "zigzag"], "'schedule' must be one of gpipe, 1f1b, interleaved-1f1b"),
    (["--microbatches", "0"], "'microbatches' must be an integer >= 1 and at most 1,024, got 0"),
    (["--schedule", "1f1b", "--chunks", "2"], "1f1b runs one model chunk per device"),
    (["--schedule", "interleaved-1f1b", "--microbatches", "3"], "multiple of the 2 devices"),
    (["--microbatches", "8", "--set", "microbatches=4"], "--microbatches and --set microbatches"),
    (["--placer", "m-etf", "--microbatches", "8"], "--microbatches is a setting of the pipeline placer"),
])
def test_bad_pipeline_flags_are_one_line_before_any_capture(flags, message, layered, capsys, monkeypatch):
    import devplace.app

    def no_capture():
        raise AssertionError("the model was captured before its flags were checked")

    monkeypatch.setattr(devplace.app, "torch_tasks", no_capture)
    placer = [] if "--placer" in flags else ["--placer", "pipeline"]
    for source in (["--model", "gpt2-xl"], [layered[0]]):
        code, _, err = run(["place", *source, "-c", layered[1], *placer, *flags], capsys, monkeypatch)
        assert message in _one_error_line(code, err)
