"""devplace.runtime exports (pipeline split points, device_map, JSON), `devplace run`/`export`/`calibrate --runs`,
the runtime placement, and benchmarks/validate_on_gpu.py --dry-run."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run_cli as _cli
from devplace.runtime import plan
from devplace.runtime.export import (
    ExportError,
    device_map,
    export_json,
    pipeline_split,
    placement_from_module_map,
)

ROOT = Path(__file__).resolve().parents[1]


def _chain() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(5)]
    return nn.Sequential(*blocks, nn.Linear(8, 3)), torch.randn(4, 8)


class _Tiny(nn.Module):
    """A zoo-contract model (returns its loss) small enough for CLI tests."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.fc(h), y)


def test_pipeline_split_builds_a_torch_pipeline():
    from torch.distributed.pipelining import pipeline

    model, x = _chain()
    p = plan(model, x, "3xGPU-placeto", placer="single")
    stages = {"0": 0, "1": 0, "2": 1, "3": 1, "4": 2, "5": 2}
    placement = placement_from_module_map(p.graph, stages)
    split = pipeline_split(p.graph, placement)
    assert split.devices == (0, 1, 2)
    assert split.split_points == ("2", "4")
    pipe = pipeline(model, mb_args=(x,), split_spec=split.split_spec())
    assert pipe.num_stages == 3
    doc = split.to_dict()
    assert doc["format"] == "devplace.pipeline/1" and [s["module"] for s in doc["split_points"]] == ["2", "4"]


class _TwoOps(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * 2.0)


def test_pipeline_split_refuses_non_contiguous_and_mid_module_cuts():
    from devplace.graph import Placement

    model, x = _chain()
    p = plan(model, x, "3xGPU-placeto", placer="round-robin")
    with pytest.raises(ExportError, match="not contiguous"):
        pipeline_split(p.graph, p.placement)
    model2 = nn.Sequential(nn.Linear(8, 8), _TwoOps(), nn.Linear(8, 3))
    p2 = plan(model2, x, "3xGPU-placeto", placer="single")
    inner = [p2.graph.ids[v] for v in range(p2.graph.num_nodes) if p2.graph.kind[v] == "forward"
             and p2.graph.ids[v].startswith("1/")]
    assert [i.split("/")[1].split("#")[0] for i in inner] == ["mul", "tanh"]
    # device 1 from the tanh on: the cut falls between two ops of module "1"
    later = set(inner[1:]) | {n for n in p2.graph.ids if n.startswith("2/")}
    cut = Placement({k: (1 if k in later else 0) for k in p2.graph.ids}, graph=p2.graph.name)
    with pytest.raises(ExportError, match="not at the start of a module call"):
        pipeline_split(p2.graph, cut)
    # from the mul on, it is the start of module "1"
    at_module = Placement({k: (1 if k in later or k == inner[0] else 0) for k in p2.graph.ids}, graph=p2.graph.name)
    assert pipeline_split(p2.graph, at_module).split_points == ("1",)


def test_device_map_names_real_modules_and_is_stable():
    from test_runtime import _cnn

    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")
    dm = device_map(p.graph, p.placement, p.cluster)
    modules = dict(model.named_modules())
    assert dm.mapping and all(name in modules for name in dm.mapping)
    assert set(dm.mapping.values()) <= {0, 1, 2}
    assert math.isfinite(dm.slowdown) and dm.slowdown > 0
    # mapping the implied placement again gives the same map (it is already at module granularity)
    assert device_map(p.graph, dm.placement, p.cluster).mapping == dm.mapping
    assert dm.named(["cuda:0", "cuda:1", "cuda:2"])[next(iter(dm.mapping))].startswith("cuda:")
    doc = export_json(p.graph, p.placement, ["cpu", "cpu", "cpu"])
    assert doc["format"] == "devplace.placement/1" and len(doc["ops"]) == p.graph.num_nodes


def test_runtime_placement_keeps_backward_with_forward():
    from test_runtime import _cnn

    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")
    rp = p.runtime_placement
    g = p.graph
    for v in range(g.num_nodes):
        if g.kind[v] in ("backward", "optimizer") and g.group[v] in g.index:
            assert rp.assignment[g.ids[v]] == rp.assignment[g.group[v]]
        if g.kind[v] == "forward" and g.op[v] != "input":
            assert rp.assignment[g.ids[v]] == p.placement.assignment[g.ids[v]]
    assert p.runtime_result.step_time_s > 0
    assert "devplace.runtime" in p.summary(text=True)




@pytest.fixture
def tiny_zoo(monkeypatch):
    from devplace.zoo import models

    def factory(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return _Tiny(), (torch.randn(batch, 3, 6, 6), torch.randint(0, 3, (batch,)))

    spec = models.ModelSpec("tiny-test", factory, 4, None, 130, "a tiny CNN for tests", "devplace")
    monkeypatch.setitem(models.MODELS, "tiny-test", spec)
    return "tiny-test"


def test_cli_run_export_and_calibrate(tiny_zoo, tmp_path, capsys, monkeypatch):
    runs, plan_path = tmp_path / "runs.jsonl", tmp_path / "plan.json"
    code, out, err = _cli(["run", "--model", tiny_zoo, "--devices", "cpu,cpu", "--placer", "round-robin",
                           "--steps", "2", "--warmup", "1", "--record", str(runs), "--save-plan", str(plan_path)],
                          capsys, monkeypatch)
    assert code == 0, err
    assert "measured step" in out and "simulated" in out
    rec = json.loads(runs.read_text().splitlines()[0])
    assert rec["format"] == "devplace.run/1" and rec["steps"] == 2 and rec["devices"] == ["cpu", "cpu"]
    assert rec["measured_step_s"] > 0
    assert rec["ratio"] == pytest.approx(rec["measured_step_s"] / rec["simulated_step_s"])
    # the saved plan runs again from the file
    code, out, err = _cli(["run", "--plan", str(plan_path), "--devices", "cpu,cpu", "--steps", "1", "--warmup", "0",
                           "--record", str(runs), "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["graph"] == rec["graph"]
    code, out, err = _cli(["calibrate", "--runs", str(runs), "--json"], capsys, monkeypatch)
    assert code == 0, err
    folded = json.loads(out)
    assert folded["runs"] == 2 and len(folded["device_kinds"]) == 1
    code, out, err = _cli(["export", str(plan_path), "--format", "device-map"], capsys, monkeypatch)
    assert code == 0, err
    assert set(json.loads(out)["device_map"]) <= set(dict(_Tiny().named_modules()))
    code, out, err = _cli(["export", str(plan_path), "--format", "json", "--devices", "cpu,cpu"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["devices"] == ["cpu", "cpu"]
    code, out, err = _cli(["export", str(plan_path), "--format", "onnx"], capsys, monkeypatch)
    assert code == 2 and "unknown export format" in err
    code, out, err = _cli(["run", "--plan", str(plan_path), "--devices", "cpu"], capsys, monkeypatch)
    assert code == 2 and "real device(s) were given" in err


def test_validate_on_gpu_dry_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("validate_on_gpu", ROOT / "benchmarks" / "validate_on_gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "v.json"
    assert mod.main(["--dry-run", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["format"] == "devplace.validate/1"
    for key in ("single_device_rel_error", "single_vs_eager_rel_error", "cpu_plus_gpu_rel_error"):
        assert math.isfinite(res["errors"][key])
    assert res["single_device"]["measured_step_s"] > 0 and res["cpu_plus_gpu"]["simulated_step_s"] > 0
    assert "DRY RUN" in capsys.readouterr().out


def test_fold_runs_groups_ratios_and_skips_other_records(tmp_path):
    from devplace.capture.profile import fold_runs, read_runs
    from devplace.errors import FormatError

    recs = [{"format": "devplace.run/1", "ratio": r, "device_kinds": ["k"], "graph": "g", "cluster": "c",
             "devices": ["cpu"]} for r in (1.0, 2.0, 4.0)]
    recs.append({"format": "devplace.run/1", "ratio": None})
    recs.append({"format": "something/1", "ratio": 3.0})
    folded = fold_runs(recs)
    assert folded["runs"] == 3 and folded["ignored"] == 2
    assert folded["device_kinds"]["k"] == {"runs": 3, "median_ratio": 2.0, "min_ratio": 1.0, "max_ratio": 4.0}
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(recs[0]) + "\n\n{not json\n")
    with pytest.raises(FormatError, match=":3: not a JSON record"):
        read_runs(path)
