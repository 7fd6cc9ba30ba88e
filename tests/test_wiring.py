"""The command line and `devplace.plan` wired to what the library has: custom `package.module:factory` models,
`--dtype`/`--amp`, hand-made module maps (`--map`), and runs in the plan's precision."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import devplace
from conftest import run_cli as run
from devplace.app import torch_tasks
from devplace.hardware.cluster import Device, load_cluster
from devplace.runtime.run import PrecisionError, local_cluster, measure_plan
from devplace.sim import simulate

NETS = '''
import torch
from torch import nn


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def build(batch=8):
    return Tower(), torch.randn(batch, 16)


def broken():
    raise ValueError("no weights here")


def no_inputs():
    return Tower(), ()
'''


@pytest.fixture
def nets(python_package):
    return python_package("wiring_pkg", NETS)


def test_custom_model_captures_places_and_runs_in_the_precision_asked(nets, tmp_path, capsys, monkeypatch):
    g = tmp_path / "g.json"
    code, out, err = run(["capture", "--model", f"{nets}:build", "--dtype", "bf16", "-o", str(g)], capsys, monkeypatch)
    assert code == 0, err
    assert "precision bfloat16" in " ".join(out.split())
    assert json.loads(g.read_text())["capture"]["dtype"] == "bfloat16"
    code, out, err = run(["place", "--model", f"{nets}:build", "-c", "2xK80", "--amp", "--json"], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["graph"] == "build-amp-bf16" and doc["precision"] == {"dtype": "float32", "amp": "bfloat16"}
    assert doc["best_single_device"]["fits"] and doc["even_split"]["fits"]
    plan_file, record = tmp_path / "plan.json", tmp_path / "runs.jsonl"
    # without micro-batches (placer auto's answer here may be a pipeline, which runs in one process per stage)
    code, out, err = run(["run", "--model", f"{nets}:build", "--batch", "4", "--dtype", "bf16", "--cluster", "2xK80",
                          "--devices", "cpu,cpu", "--steps", "1", "--warmup", "0", "--save-plan", str(plan_file),
                          "--record", str(record), "--schedule", "none"], capsys, monkeypatch)
    assert code == 0, err
    text = " ".join(out.split())
    assert "precision bfloat16" in text and "baselines: best single device" in text
    rec = json.loads(record.read_text().splitlines()[-1])
    assert rec["settings"]["source"] == {"custom": f"{nets}:build", "batch": 4, "seq_len": None, "build_seed": 0}
    # the saved plan rebuilds the custom model and runs it in bf16 again, once the user repeats its name (a plan
    # file alone runs no code: issue 24)
    again = ["run", "--plan", str(plan_file), "--devices", "cpu,cpu", "--steps", "1", "--warmup", "0", "--record",
             str(record)]
    code, out, err = run(again, capsys, monkeypatch)
    assert code == 2 and "--trust-model" in err and len(record.read_text().splitlines()) == 1
    code, out, err = run([*again, "--model", f"{nets}:build"], capsys, monkeypatch)
    assert code == 0, err
    assert len(record.read_text().splitlines()) == 2


def test_place_by_a_module_map_reports_it_as_run_with_the_baselines(nets, tmp_path, capsys, monkeypatch):
    mapping = {"stem": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1, "head": 1,
               "head.bias": 1}  # a tensor name, as accelerate writes for a split module's own tensors
    path = tmp_path / "map.json"
    path.write_text(json.dumps(mapping))
    code, out, err = run(["place", "--model", f"{nets}:build", "-c", "2xK80", "--map", str(path), "--json"], capsys,
                         monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    c = load_cluster("2xK80")
    prepared = torch_tasks().prepare_model(f"{nets}:build", device=c.devices[0])
    expected = devplace.placement_from_module_map(prepared.full, c, mapping, tensors=["head.bias"])
    assert doc["assignment"] == expected.assignment and set(expected.assignment.values()) == {0, 1}
    assert doc["step_time_s"] == simulate(prepared.full, c, expected).step_time_s
    assert doc["placer"] == "module map" and doc["as_run"]["ops_moved"] == 0
    assert doc["best_single_device"]["speedup"] is not None and "speedup" in doc["even_split"]
    code, out, err = run(["place", "--model", f"{nets}:build", "-c", "2xK80", "--map", str(path)], capsys, monkeypatch)
    text = " ".join(out.split())  # the report wraps at the console's width
    squeezed = "".join(out.split())  # and folds a path longer than the width inside it (pytest-10 and on)
    assert code == 0 and f"modulemap{path}:placed" in squeezed and "baselines: best single device" in text


def test_place_a_captured_graph_file_by_a_map(nets, tmp_path, capsys, monkeypatch):
    coarse, full, path = tmp_path / "g.json", tmp_path / "full.json", tmp_path / "map.json"
    path.write_text(json.dumps(["blocks.2"]))  # split points: stage 1 begins where blocks.2 does
    code, _, err = run(["capture", "--model", f"{nets}:build", "-o", str(coarse), "--full", str(full)], capsys,
                       monkeypatch)
    assert code == 0, err
    code, out, err = run(["place", str(full), "-c", "2xK80", "--map", str(path), "--json"], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(out)
    g = devplace.load_graph(full)
    expected = devplace.placement_from_module_map(g, load_cluster("2xK80"), ["blocks.2"])
    assert doc["assignment"] == expected.assignment and doc["settings"] == {"module_map": str(path)}
    assert doc["even_split"]["fits"] and doc["best_single_device"]["fits"]


@pytest.mark.parametrize(("args", "message"), [
    (["capture", "--model", "{m}:broken", "-o", "{tmp}/g.json"], "custom model 'wiring_pkg.nets:broken' failed: "
                                                                 "ValueError: no weights here"),
    (["capture", "--model", "{m}:no_inputs", "-o", "{tmp}/g.json"], "example_inputs must be a tensor or a non-empty"),
    (["capture", "--model", "{m}:nothing", "-o", "{tmp}/g.json"], "has no attribute 'nothing'"),
    (["place", "--model", "wiring_missing.nets:build", "-c", "2xK80"], "cannot import module 'wiring_missing.nets'"),
    (["place", "--model", "{m}:build", "-c", "2xK80", "--map", "{tmp}/map.json", "--placer", "heft"],
     "--map places by the map, not by a placer; drop --placer"),
    (["place", "--model", "{m}:build", "-c", "2xK80", "--map", "{tmp}/map.json"], "module map names module 'stme'"),
    (["place", "example", "-c", "2xK80", "--dtype", "bf16"], "--dtype/--amp are for --model"),
    (["capture", "--model", "{m}:build", "--dtype", "fp8", "-o", "{tmp}/g.json"], "unknown dtype 'fp8'"),
    (["run", "--plan", "{tmp}/plan.json", "--amp"], "a plan file runs in the precision it was made in"),
    (["capture", "--onnx", "{tmp}/m.onnx", "--amp", "-o", "{tmp}/g.json"], "--amp needs a PyTorch model"),
])
def test_wiring_errors_are_one_line(args, message, nets, tmp_path, capsys, monkeypatch):
    (tmp_path / "map.json").write_text(json.dumps({"stme": 0}))
    code, out, err = run([a.format(m=nets, tmp=tmp_path) for a in args], capsys, monkeypatch)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def _tower() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)


@pytest.mark.parametrize(("kw", "param_dtype", "loss_dtype"), [
    ({}, torch.float32, torch.float32), ({"dtype": "bf16"}, torch.bfloat16, torch.bfloat16),
    ({"amp": True}, torch.float32, torch.bfloat16), ({"dtype": "fp16", "amp": True}, torch.float32, torch.float16),
])
def test_runs_are_in_the_plans_precision(kw, param_dtype, loss_dtype):
    module, x = _tower()
    p = devplace.plan(module, x, "2xK80", placer="even", **kw)
    assert p.settings["dtype"] == kw.get("dtype") and p.settings["amp"] == kw.get("amp", False)
    placed, ran, _ = measure_plan(p, module, x, "cpu,cpu", steps=1, warmup=0)
    assert placed.granularity == "op"  # the trace (under autocast for amp) matches the capture op for op
    assert next(module.parameters()).dtype == param_dtype
    # the loss was computed in the plan's precision: it is exactly representable in that dtype
    loss = torch.tensor(ran.losses[0], dtype=torch.float64)
    assert torch.equal(loss.to(loss_dtype).to(torch.float64), loss)
    if loss_dtype != torch.float32:
        fp32, _ = _tower()
        _, ran32, _ = measure_plan(devplace.plan(fp32, x, "2xK80", placer="even"), fp32, x, "cpu,cpu", steps=1,
                                   warmup=0)
        assert ran32.losses[0] != ran.losses[0]


def test_a_module_in_another_precision_than_the_plan_is_refused():
    module, x = _tower()
    p = devplace.plan(module.to(torch.bfloat16), x.to(torch.bfloat16), "2xK80", placer="even")
    fp32, _ = _tower()
    with pytest.raises(PrecisionError, match="captured with bfloat16 parameters but this module's are float32"):
        measure_plan(p, fp32, x, "cpu,cpu", steps=1, warmup=0)


def test_local_cluster_keeps_every_figure_of_the_measured_device():
    spec = Device("cpu-measured", 1e9, 0.5, peak_flops=2e12, mem_bandwidth_Bps=5e10, kind="cpu: test",
                  peak_flops_fp32=1e12, peak_flops_bf16=3e12)
    c = local_cluster(["cpu", "cpu"], specs={torch.device("cpu"): spec})
    assert [d.name for d in c.devices] == ["cpu#0", "cpu#1"]
    assert all(d == dataclasses.replace(spec, name=d.name) for d in c.devices)
