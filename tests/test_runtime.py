"""devplace.runtime: plans, placed modules numerically equal to the unplaced ones, plan files, bad inputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import fx, nn

import devplace
from devplace.errors import DevplaceError, FormatError
from devplace.graph import Placement
from devplace.runtime import ApplyError, load_plan, plan

CPU3 = ["cpu", "cpu", "cpu"]


class SmallCNN(nn.Module):
    """Convolutions, batch norm (in-place running statistics), an in-place ReLU and a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv1(x)))
        h = h + torch.relu_(self.conv2(h))
        return nn.functional.cross_entropy(self.fc(self.pool(h).flatten(1)), y)


class SmallTransformer(nn.Module):
    """Embedding, two encoder layers (attention, layer norm, GELU), tied output projection."""

    def __init__(self, vocab: int = 17, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, activation="gelu", batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.enc(self.emb(tokens)))
        logits = h @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return SmallCNN(), (torch.randn(2, 3, 8, 8), torch.tensor([1, 3]))


def _transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return SmallTransformer(), (torch.randint(0, 17, (2, 6)),)


def _zoo() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from devplace.zoo.families import family_model

    module, inputs, _ = family_model("nmt", 0, batch=2, seq_len=4)
    return module, tuple(inputs)


def _step(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    torch.manual_seed(1)  # dropout, if any, draws the same numbers in both runs
    loss = module(*inputs)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("build", [_cnn, _transformer, _zoo], ids=["cnn", "transformer", "zoo-nmt"])
def test_placed_training_step_equals_unplaced(build):
    model, inputs = build()
    reference = copy.deepcopy(model)
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")
    assert p.num_devices_used == 3
    placed = p.apply(model, CPU3)
    loss = _step(placed, inputs)
    ref_loss = _step(reference, inputs)
    assert placed.granularity == "op"  # the traced ops matched the captured ones exactly
    assert placed.crossings >= 5  # the forward really hops between logical devices
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    named = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, named[name].grad, rtol=1e-5, atol=1e-6, msg=f"grad of {name}")
        torch.testing.assert_close(param, named[name], rtol=1e-5, atol=1e-6, msg=f"{name} after the step")
    for (name, buf), ref_buf in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(buf, ref_buf, msg=f"buffer {name}")


@pytest.mark.parametrize("build", [_cnn, _transformer], ids=["cnn", "transformer"])
def test_one_cpu_plan_runs_the_generated_code_bitwise_as_the_interpreter(build):
    """A plan on one CPU device runs the traced program's generated code (no interpreter): loss, gradients,
    updated parameters and buffers bitwise equal to the interpreted run's; a plan that moves tensors between
    devices keeps the interpreter."""
    model, inputs = build()
    twin = copy.deepcopy(model)
    p = plan(model, inputs, "3xGPU-placeto", placer="single")
    assert p.num_devices_used == 1
    direct, interpreted = p.apply(model, ["cpu"], example_inputs=inputs), p.apply(twin, ["cpu"], example_inputs=inputs)
    (key, (*cached, runs_direct)), = interpreted._traces.items()
    assert runs_direct
    interpreted._traces[key] = (*cached, False)  # force the interpreter on the twin
    assert torch.equal(_step(direct, inputs), _step(interpreted, inputs))
    named = dict(twin.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, named[name].grad), name
        assert torch.equal(param, named[name]), name
    for buf, twin_buf in zip(model.buffers(), twin.buffers(), strict=True):
        assert torch.equal(buf, twin_buf)
    spread = plan(model, inputs, "3xGPU-placeto", placer="round-robin").apply(copy.deepcopy(model), CPU3,
                                                                               example_inputs=inputs)
    assert [direct for *_, direct in spread._traces.values()] == [False]


def test_mapping_is_exact_op_for_op():
    """Every traced forward op carries the id of the captured op it is, in the captured order, with its op."""
    from devplace.runtime.apply import _exact_mapping, trace_forward

    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")
    trace = trace_forward(model, inputs, {})
    forward = [p.graph.ids[v] for v in range(p.graph.num_nodes)
               if p.graph.kind[v] == "forward" and p.graph.op[v] != "input"]
    traced = [cid for cid, _ in trace.ids.values()]
    assert traced == forward  # the loss is inside the module: nothing left over
    assert _exact_mapping(trace, p.graph)
    # a graph whose op names differ is not an exact match
    renamed = [p.graph.node_record(v) | ({"op": "aten.mul.Tensor"} if p.graph.ids[v] == traced[0] else {})
               for v in range(p.graph.num_nodes)]
    other = devplace.CompGraph.build(p.graph.name, renamed, [p.graph.edge_record(e) for e in range(p.graph.num_edges)])
    assert not _exact_mapping(trace, other)


def test_devices_follow_placement_and_parameters_move():
    """Parameters live where their first consumer is placed; outputs carry the placed logical devices."""
    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="single")
    placed = p.apply(model, ["cpu"])
    assert placed.crossings == 0
    torch.testing.assert_close(placed(*inputs), _cnn()[0](*inputs))


def test_plan_round_trips_through_json(tmp_path):
    model, inputs = _cnn()
    p = devplace.plan(model, inputs, "3xGPU-placeto", placer="round-robin", seed=3)
    path = tmp_path / "plan.json"
    p.save(path)
    q = devplace.load_plan(path)
    assert q.placement.assignment == p.placement.assignment
    assert q.graph.ids == p.graph.ids and q.cluster.name == p.cluster.name
    assert q.result.step_time_s == p.result.step_time_s
    assert q.settings["placer"] == "round-robin" and q.settings["seed"] == 3
    assert "step time" in q.summary(text=True)
    # a loaded plan applies (traced on the first call)
    placed = q.apply(_cnn()[0], CPU3)
    torch.testing.assert_close(placed(*inputs), _cnn()[0](*inputs))
    doc = json.loads(path.read_text())
    doc["format"] = "devplace.plan/9"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="unknown version"):
        load_plan(path)


def test_fewer_devices_than_the_placement_needs():
    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")
    with pytest.raises(ApplyError, match="uses 3 devices"):
        p.apply(model, ["cpu", "cpu"])


def test_placement_for_another_graph():
    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")
    wrong = Placement(dict(p.placement.assignment), graph="some-other-graph")
    from devplace.runtime import apply_placement

    with pytest.raises(DevplaceError, match="is for graph 'some-other-graph'"):
        apply_placement(model, p.graph, wrong, CPU3)
    partial = Placement(dict(list(p.placement.assignment.items())[:-3]), graph=p.graph.name)
    with pytest.raises(DevplaceError, match="no device for 3 node"):
        apply_placement(model, p.graph, partial, CPU3)
    other, _ = _transformer()
    with pytest.raises(DevplaceError, match="apply a plan made for this model"):
        p.apply(other, CPU3)


def test_bad_devices():
    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="single")
    with pytest.raises(ApplyError, match="not a torch device"):
        p.apply(model, ["gpu-zero"])
    if not torch.cuda.is_available():
        with pytest.raises(ApplyError, match="needs CUDA"):
            p.apply(model, ["cuda:0"])


def test_module_granularity_fallback_when_the_trace_differs():
    """In eval mode batch norm runs another op than the (training-mode) capture recorded: the mapping is not
    exact, so the placement falls back to module granularity, says so, and still computes the same values."""
    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")
    reference = copy.deepcopy(model).eval()
    placed = p.apply(model, CPU3)
    model.eval()
    with pytest.warns(UserWarning, match="module granularity"):
        out = placed(*inputs)
    assert placed.granularity == "module"
    torch.testing.assert_close(out, reference(*inputs))



def test_cpu_fused_attention_runs_portably_off_the_cpu():
    """The CPU-only fused attention kernel the capture records is computed with the math kernel elsewhere."""
    from devplace.runtime.apply import _CPU_FLASH, _call

    if _CPU_FLASH is None:
        pytest.skip("this torch has no CPU flash attention op")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    want = _CPU_FLASH(q, k, v, 0.0, True)[0]
    node = fx.Graph().call_function(_CPU_FLASH, ())
    got, _ = _call(node, torch.device("cuda", 0), (q, k, v, 0.0, True), {})  # tensors stay on the CPU
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # deepcopy in TransformerEncoder
@pytest.mark.parametrize("build", [_cnn, _transformer], ids=["cnn", "transformer"])
def test_forward_on_three_fake_gpus_keeps_every_op_on_one_device(build, monkeypatch):
    """Without GPUs, fake CUDA tensors check device handling: a fake tensor op given inputs on two devices
    raises, so a forward that runs proves every placed op got its inputs moved to its own device (and the
    CPU-only attention kernel the capture recorded was replaced). Backward needs a real CUDA context."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, inputs = build()
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_model, fake_inputs = build()
        # tensors made by torch.tensor(...) (batch norm's step counter, the labels) are fake *constants*, which
        # fake ops evaluate for real (on CUDA: no driver); plain fakes of the same shape carry no value
        fake_inputs = tuple(torch.empty(x.shape, dtype=x.dtype) for x in fake_inputs)
        for mod in fake_model.modules():
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[k] = torch.empty(b.shape, dtype=b.dtype)
        placed = p.apply(fake_model, ["cuda:0", "cuda:1", "cuda:2"], example_inputs=fake_inputs)
        loss = placed(*fake_inputs)
    assert loss.device.type == "cuda" and loss.shape == ()
    assert placed.crossings >= 5 and placed.granularity == "op"
    # parameters are homed on several devices (a fake tensor's reported device ignores `.data =`, so the
    # homes are read from the trace here; test_placed_training_step_equals_unplaced runs the real move)
    (_, _, homes, direct), = placed._traces.values()
    assert not direct  # three devices: interpreted, each op on its own
    assert len(set(homes.values())) >= 2


def test_plan_with_the_pipeline_placer_reports_and_keeps_the_scheduled_step(tmp_path):
    from devplace.sim import ScheduledResult, simulate

    model, _ = _transformer()
    inputs = (torch.randint(0, 17, (4, 6)),)  # 4 micro-batches of one sequence each
    p = devplace.plan(model, inputs, "3xGPU-placeto", placer="pipeline", schedule="1f1b", microbatches=4)
    schedule = p.placement.schedule
    assert (schedule.kind, schedule.microbatches) == ("1f1b", 4)
    assert isinstance(p.result, ScheduledResult)
    assert p.result.step_time_s == simulate(p.graph, p.cluster, p.placement, schedule=schedule).step_time_s
    # placed on one micro-batch captured at its own size (batch 1), like `devplace place --model`
    assert schedule.microbatch_graph and p.graph.meta["capture"]["batch"] == 1
    one = simulate(p.graph, p.cluster, p.placement).step_time_s  # one micro-batch's step, without the schedule
    assert p.result.step_time_s < 4 * one  # M = 4 overlaps stages: faster than the 4 micro-batches in turn
    assert "schedule 1f1b: M = 4 micro-batches" in " ".join(p.summary(text=True).split())
    path = tmp_path / "plan.json"
    p.save(path)
    q = load_plan(path)
    assert q.placement.schedule == schedule
    assert q.result.step_time_s == p.result.step_time_s
