"""`devplace demo` (issue 12; issue 31: its answer is the default search's): devplace's answer, the pipeline placer,
the even split under the same schedule, a placement without micro-batches and the best single device, on a model
that does not fit one device."""

from __future__ import annotations

import json

import torch
from torch import nn

from conftest import run_cli
from devplace.app.with_torch import demo as run_demo
from devplace.app.with_torch import place_prepared
from devplace.capture.pipeline import prepare
from devplace.capture.torch_capture import capture
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.placers.memory import memory_needs
from devplace.sim import Schedule, ScheduledResult


def _prepared():
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(64, 64), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    g = capture(model, (torch.randn(32, 64),), loss_fn=lambda out: out.square().mean())
    return prepare(g)


def test_demo_compares_the_pipeline_with_the_even_split_and_the_unpipelined_step(tmp_path):
    prepared = _prepared()
    need = memory_needs(prepared.full).total_bytes
    # four devices of 45% of the step: no one device holds it, and the weights and state fit on two
    c = Cluster("four", tuple(Device(f"d{i}", 0.45 * need, kind="V100") for i in range(4)), Link(1e10, 1e-5))
    demo = run_demo(prepared, c, schedule="1f1b", microbatches=4, out=tmp_path, name="mlp")
    labels = [r.label for r in demo.compared]
    assert labels == ["single d0", "contiguous", "even split", "pipeline placer", "devplace (default)"]
    single, _, even, ours, answer = demo.compared
    # the answer is the default search's, never slower than the pipeline placer it also reports
    assert answer.result is demo.answer.result
    assert demo.answer.result.step_time_s == place_prepared(prepared, c).result.step_time_s
    assert answer.result.step_time_s <= ours.result.step_time_s
    assert not single.result.feasible  # the model does not fit one device
    assert ours.result is demo.placed.result and ours.result.feasible
    assert demo.placed.placement.schedule == Schedule("1f1b", 4)
    assert isinstance(even.result, ScheduledResult) and even.result.schedule == Schedule("1f1b", 4)
    assert ours.result.step_time_s >= demo.placed.bound.work_s
    assert demo.estimate_s == demo.placed.bound.work_s * (4 + 4 - 1) / 4
    doc = json.loads(json.dumps(demo.to_dict()))
    assert [r["placement"] for r in doc["compared"]] == labels
    assert doc["compared"][-2]["step_time_s"] == ours.result.step_time_s
    text = " ".join(demo.text().split())
    assert "schedule 1f1b: M = 4 micro-batches" in text and "pipeline placer" in text
    assert "even-stage estimate 1f1b" in text
    assert {p.name for p in tmp_path.iterdir()} == {"mlp.placement.json", "mlp-trace.json", "mlp-timeline.png"}


def test_demo_flags_are_checked_before_the_capture(capsys, monkeypatch):
    import devplace.app

    def no_capture():
        raise AssertionError("the model was captured before the flags were checked")

    monkeypatch.setattr(devplace.app, "torch_tasks", no_capture)
    for flags, message in ((["--microbatches", "0"], "'microbatches' must be an integer >= 1"),
                           (["--schedule", "zigzag"], "'schedule' must be one of"),
                           (["--baseline", "nope"], "unknown placer 'nope'")):
        code, _, err = run_cli(["demo", *flags], capsys, monkeypatch)
        assert code == 2 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
