"""Placer auto compares pipelined and unpipelined placements (issue 21, item 2): on a graph whose batch can be
split it places the step without micro-batches and as a pipeline and keeps the faster, says what it compared, and
`schedule="none"` keeps it to placements without micro-batches."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from devplace.app.with_torch import place_prepared, prepare_model
from devplace.capture.pipeline import prepare
from devplace.capture.torch_capture import capture
from devplace.defaults import AUTO_PIPELINE, AUTO_PLACERS
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.placers import place, schedule_of
from devplace.placers.registry import auto_candidates

NETS = '''
import torch
from torch import nn


def build(batch=8):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())], nn.Linear(512, 4))
    return model, torch.randn(batch, 512)
'''


@pytest.fixture
def mlp(tmp_path, monkeypatch):
    pkg = tmp_path / "auto_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(textwrap.dedent(NETS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "auto_pkg.nets:build"
    for name in [n for n in sys.modules if n.startswith("auto_pkg")]:
        del sys.modules[name]


def _graph(batch: int) -> CompGraph:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 4))
    return prepare(capture(model, (torch.randn(batch, 64),), loss_fn=lambda out: out.square().mean())).full


def _slow_links(n: int = 2) -> Cluster:
    return Cluster("two", tuple(Device(f"d{i}", 1e9, kind="V100") for i in range(n)), Link(1e8, 1e-5))


def test_auto_compares_a_pipeline_where_the_batch_can_be_split():
    g = _graph(8)
    assert auto_candidates(g, None) == (*AUTO_PLACERS, AUTO_PIPELINE)
    assert auto_candidates(g, "none") == AUTO_PLACERS
    assert auto_candidates(g, "interleaved-1f1b") == (AUTO_PIPELINE,)
    assert auto_candidates(_graph(1), None) == AUTO_PLACERS  # one sample: no micro-batches
    p = place(g, _slow_links(), order="topo")
    tried = p.meta["placer_auto"]["tried"]
    assert set(tried) == {*AUTO_PLACERS, AUTO_PIPELINE}
    assert p.meta["step_time_s"] == min(t for t in tried.values() if isinstance(t, float))
    flat = place(g, _slow_links(), order="topo", schedule="none")
    assert schedule_of(flat) is None and AUTO_PIPELINE not in flat.meta["placer_auto"]["tried"]
    piped = place(g, _slow_links(), order="topo", schedule="gpipe")
    assert schedule_of(piped).kind == "gpipe"
    with pytest.raises(DevplaceError, match="schedule must be one of none, gpipe, 1f1b"):
        place(g, _slow_links(), schedule="zigzag")


def test_auto_on_a_captured_model_compares_unpipelined_and_pipelined_micro_batches(mlp):
    prepared = prepare_model(mlp, batch=8)
    cluster = _slow_links(4)
    placed = place_prepared(prepared, cluster, order="topo")
    meta = placed.placement.meta["placer_auto"]
    steps = {k: t for k, t in meta["tried"].items() if k in meta["time_s"]}
    assert set(steps) == {"unpipelined", "pipeline 1f1b", "pipeline interleaved-1f1b"}
    assert placed.result.step_time_s == min(t for t in steps.values() if isinstance(t, float))
    if schedule_of(placed.placement) is not None:  # a pipeline kept: on micro-batches of their own size
        assert schedule_of(placed.placement).microbatch_graph or schedule_of(placed.placement).microbatches == 1
    text = " ".join(placed.text().split())
    assert "placer auto ->" in text and "pipeline 1f1b" in text
    flat = place_prepared(prepared, cluster, order="topo", settings={"schedule": "none"})
    assert schedule_of(flat.placement) is None
    assert set(flat.placement.meta["placer_auto"]["time_s"]) == {"unpipelined"}
    assert flat.result.step_time_s == steps["unpipelined"]
