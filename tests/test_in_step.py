"""devplace.runtime.in_step: op times measured inside real training steps (`devplace profile --in-step`)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from devplace.capture import capture
from devplace.capture.profile import local_cpu_device
from devplace.hardware.cost import CostError, CostTable, apply_costs, signature_key
from devplace.runtime.in_step import IN_STEP, _shape_key, merge_tables, profile_in_step


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)


def _net() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return _Net(), (torch.randn(4, 8), torch.tensor([0, 2, 1, 0]))


def test_every_op_of_the_step_is_timed_inside_it():
    """Forward, backward and Adam's update (whose scalar arguments change every step) all get a time from the
    steps, so a table of them costs the whole graph without the isolated profile."""
    module, inputs = _net()
    graph = capture(module, inputs)
    cpu = local_cpu_device()
    table = profile_in_step(graph, module, inputs, cpu, steps=2, warmup=1)
    sigs = {signature_key(x["sig"]) for x in graph.node_extra if isinstance(x.get("sig"), dict)}
    kinds = {graph.kind[v] for v in range(graph.num_nodes) if isinstance(graph.node_extra[v].get("sig"), dict)}
    assert {"forward", "backward", "optimizer"} <= kinds
    # and the adds of later micro-batches' gradients into .grad and their division by M, timed in steps of two
    # passes (one of each per parameter)
    adds = {signature_key(a[k]) for x in graph.node_extra for a in x.get("accumulates", [])
            for k in ("sig", "scale_sig")}
    assert len(adds) == 8 and not adds & sigs
    assert set(table.entries) == sigs | adds and all(t > 0 for t in table.entries.values())
    assert table.meta["timer"] == IN_STEP and table.device_kind == cpu.kind and table.repeats == 2
    _, report = apply_costs(graph, cpu, table)
    assert report.profiled_nodes == sum(1 for x in graph.node_extra if isinstance(x.get("sig"), dict))


def test_profile_in_step_refuses_a_model_off_the_cpu():
    module, inputs = _net()
    graph = capture(module, inputs)
    with torch.device("meta"):
        on_meta = _Net()
    with pytest.raises(CostError, match="must be on the CPU"):
        profile_in_step(graph, on_meta, inputs, local_cpu_device())


def test_shape_key_leaves_out_floats_only():
    sig = {"target": "aten.add.Tensor", "args": [{"tensor": [2, 3], "dtype": "float32", "stride": [3, 1]}, 0.5],
           "kwargs": {"alpha": 2}}
    assert _shape_key(sig) == _shape_key({**sig, "args": [sig["args"][0], -0.25]})
    assert _shape_key(sig) != _shape_key({**sig, "kwargs": {"alpha": 3}})
    assert _shape_key(sig) != _shape_key({**sig, "args": [{**sig["args"][0], "tensor": [3, 2]}, 0.5]})
    assert json.loads(_shape_key(sig))["args"][1] == "float"


def test_merge_tables_later_wins_and_kinds_must_agree():
    cpu = local_cpu_device()
    alone = CostTable(cpu.kind, {"a": 1.0, "b": 2.0}, skipped={"c": "x", "d": "y"}, device=cpu)
    inside = CostTable(cpu.kind, {"b": 5.0, "c": 3.0}, meta={"timer": IN_STEP})
    merged = merge_tables([alone, inside])
    assert merged.entries == {"a": 1.0, "b": 5.0, "c": 3.0} and merged.skipped == {"d": "y"}
    assert merged.meta["timer"] == IN_STEP and merged.device == cpu
    with pytest.raises(CostError, match="different devices"):
        merge_tables([alone, CostTable("cpu: other x1", {})])


def test_cli_profile_in_step(python_package, tmp_path, capsys, monkeypatch):
    """`devplace profile --in-step` keeps the in-step times (meta timer "in-step"); on a GPU it is refused in one
    line, exit 2."""
    from conftest import run_cli

    pkg = python_package("instep", """
        import torch
        def factory(batch=4):
            return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()), (torch.randn(batch, 8),)
        """)
    code, out, err = run_cli(["profile", "--model", f"{pkg}:factory", "--threads", "1", "--repeats", "2", "--in-step",
                              "--no-overheads", "-o", str(tmp_path / "c.json")], capsys, monkeypatch)
    assert code == 0, err
    assert "inside real steps" in " ".join((out + err).split())
    table = CostTable.load(tmp_path / "c.json")
    assert table.meta["timer"] == IN_STEP and table.entries
    code, _, err = run_cli(["profile", "--model", f"{pkg}:factory", "--device", "cuda", "--in-step", "-o",
                            str(tmp_path / "g.json")], capsys, monkeypatch)
    assert code == 2 and "--in-step" in err and "Traceback" not in err


def test_each_phase_of_the_graph_sums_to_what_the_phase_took(monkeypatch):
    """The timer's window misses what happens around an op (autograd's recording, the engine), so each op's time is
    scaled by its phase's factor; under a fake clock where every timed op takes 1 us and every phase of an
    untimed step 1 ms, the graph's ops of each phase sum to 1 ms (unscaled: 1 us per op)."""
    import devplace.runtime.in_step as in_step

    ns, s = [0], [0.0]

    def tick_ns() -> int:  # TimeEachOp reads it twice per op: every op 1 us
        ns[0] += 500
        return ns[0]

    def tick_s() -> float:  # read at each phase's start and end: every phase 1 ms
        s[0] += 0.001
        return s[0]

    monkeypatch.setattr(in_step.time, "thread_time_ns", tick_ns)
    monkeypatch.setattr(in_step.time, "thread_time", tick_s)
    module, inputs = _net()
    graph = capture(module, inputs)
    table = profile_in_step(graph, module, inputs, local_cpu_device(), steps=3, warmup=1, optimizer="adam")
    assert set(table.meta["phase_factors"]) == {"forward", "backward", "update"}
    by_kind: dict[str, float] = {}
    for v, x in enumerate(graph.node_extra):
        if isinstance(x.get("sig"), dict):
            by_kind[graph.kind[v]] = by_kind.get(graph.kind[v], 0.0) + table.entries[signature_key(x["sig"])]
    assert by_kind == pytest.approx({"forward": 1e-3, "backward": 1e-3, "optimizer": 1e-3}, rel=1e-9)
