"""devplace.runtime exports (pipeline split points, device_map, JSON), `devplace run`/`export`/`calibrate --runs`,
the runtime placement, and benchmarks/validate_on_gpu.py --dry-run."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import run_cli as _cli
from devplace.errors import DevplaceError
from devplace.graph.modules import forward_ops, module_starts
from devplace.graph.parallel import ParallelPlan
from devplace.runtime import plan
from devplace.runtime.export import ExportError, device_map, export_json, pipeline_split, read_pipeline
from devplace.runtime.module_map import placement_from_module_map
from devplace.runtime.parallel_export import parallel_export, read_parallel

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
    placement = placement_from_module_map(p.graph, p.cluster, stages)
    split = pipeline_split(p.graph, placement, p.cluster, model)
    assert split.devices == (0, 1, 2)
    assert split.split_points == ("2", "4")
    # without the model, the Sequentials "2" and "4" (no ops of their own) give way to their first children
    assert pipeline_split(p.graph, placement).split_points == ("2.0", "4.0")
    # a placement that is a pipeline already exports as itself, at no cost
    assert split.placement.assignment == placement.assignment and split.moved_fraction == 0.0
    assert split.slowdown == pytest.approx(1.0) and split.feasible
    pipe = pipeline(model, mb_args=(x,), split_spec=split.split_spec())
    assert pipe.num_stages == 3
    doc = split.to_dict()
    assert doc["format"] == "devplace.pipeline/3" and [s["module"] for s in doc["split_points"]] == ["2", "4"]
    assert doc["schedule"]["kind"] == "1f1b" and doc["schedule"]["microbatches"] == 3  # the default: one per stage


def test_exports_written_before_they_carried_precision_still_load(tmp_path):
    """"precision" came with devplace.pipeline/3 and devplace.parallel/2 (read by an older devplace, such a file
    would run in fp32): exports write those, a pipeline/2 or parallel/1 file still loads (in fp32 where it records
    no precision), and a version this devplace does not know is refused naming the ones it reads."""
    old_pipe = {"format": "devplace.pipeline/2", "split_points": [{"module": "2", "point": "beginning"}],
                "stage_devices": [0, 1], "schedule": {"kind": "1f1b", "microbatches": 2}}
    par = parallel_export(ParallelPlan(dp=2, pp=2, microbatches=2, batch=8), ["2"],
                          precision={"autocast": "bfloat16"})
    assert par["format"] == "devplace.parallel/2"
    old_par = {k: v for k, v in par.items() if k != "precision"} | {"format": "devplace.parallel/1"}
    path = tmp_path / "export.json"
    for read, old, new, unknown in [(read_pipeline, old_pipe, "devplace.pipeline/3", "devplace.pipeline/4"),
                                    (read_parallel, old_par, "devplace.parallel/2", "devplace.parallel/3")]:
        path.write_text(json.dumps(old))
        ex = read(path)
        assert ex.split_points == ("2",) and ex.precision == {}
        assert read(old | {"precision": {"dtype": "bf16"}}).precision == {"dtype": "bf16"}  # one written in between
        assert read(old | {"format": new, "precision": {"autocast": "bfloat16"}}).precision == {"autocast": "bfloat16"}
        path.write_text(json.dumps(old | {"format": unknown}))
        with pytest.raises(ExportError, match=f"unknown version '{unknown}'; this devplace reads '{new}' "
                                              f"\\(or older '{old['format']}'\\)"):
            read(path)
        with pytest.raises(ExportError, match=f"'{unknown}' is not '{new}' or '{old['format']}'"):
            read(old | {"format": unknown})


class _TwoOps(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * 2.0)


def test_pipeline_split_approximates_any_placement_with_contiguous_module_stages():
    from devplace.graph import Placement

    model, x = _chain()
    p = plan(model, x, "3xGPU-placeto", placer="round-robin")
    split = pipeline_split(p.graph, p.placement, p.cluster)
    g = p.graph
    fwd = forward_ops(g)
    fdev = [split.placement.assignment[g.ids[v]] for v in fwd]
    runs = [d for i, d in enumerate(fdev) if i == 0 or d != fdev[i - 1]]
    assert tuple(runs) == split.devices and len(set(runs)) == len(runs)  # one contiguous stage per device
    starts = module_starts([str(g.node_extra[v].get("module", "")) for v in fwd])
    assert [starts[i] for i in range(1, len(fwd)) if fdev[i] != fdev[i - 1]] == list(split.split_points)
    # round-robin is far from a pipeline: the export says how much work moved and what it costs
    assert 0.0 < split.moved_fraction < 1.0
    assert split.step_time_s is not None and split.step_time_s > 0 and split.slowdown is not None
    assert split.to_dict()["step_time_s"] == split.step_time_s
    # a cut inside a module moves to that module call's beginning
    model2 = nn.Sequential(nn.Linear(8, 8), _TwoOps(), nn.Linear(8, 3))
    p2 = plan(model2, x, "3xGPU-placeto", placer="single")
    inner = [p2.graph.ids[v] for v in range(p2.graph.num_nodes) if p2.graph.kind[v] == "forward"
             and p2.graph.ids[v].startswith("1/")]
    assert [i.split("/")[1].split("#")[0] for i in inner] == ["mul", "tanh"]
    later = set(inner[1:]) | {n for n in p2.graph.ids if n.startswith("2/")}
    cut = Placement({k: (1 if k in later else 0) for k in p2.graph.ids}, graph=p2.graph.name)
    moved = pipeline_split(p2.graph, cut)
    assert moved.devices == (0, 1) and moved.split_points in (("1",), ("2",)) and moved.moved_fraction > 0
    assert moved.step_time_s is None and moved.feasible is None  # no cluster: no simulation


def test_graphs_without_modules_say_to_use_json():
    from conftest import cluster, graph
    from devplace.graph import Placement
    from devplace.runtime.export import ExportError

    g = graph([("a", 1.0), ("b", 1.0)], [("a", "b", 4)])
    placement = Placement({"a": 0, "b": 1}, graph=g.name)
    for export in (lambda: pipeline_split(g, placement), lambda: device_map(g, placement, cluster(2))):
        with pytest.raises(ExportError, match=r"no module paths .* export it as json"):
            export()
    assert export_json(g, placement)["ops"]["b"]["device"] == 1


class _SharedAct(nn.Module):
    """One activation module called twice: a split at its beginning would split at both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.act, self.l2, self.l3 = nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.act(self.l2(self.act(self.l1(x)))))


def test_pipeline_split_never_names_a_module_called_twice():
    from torch.distributed.pipelining import pipeline

    torch.manual_seed(0)
    model, x = _SharedAct(), torch.randn(4, 8)
    p = plan(model, x, "3xGPU-placeto", placer="single")
    placement = placement_from_module_map(p.graph, p.cluster, {"l1": 0, "act": 1, "l2": 1, "l3": 1})
    split = pipeline_split(p.graph, placement, p.cluster, model)
    assert split.split_points == ("l2",) and split.moved_fraction > 0  # the first tanh moves to stage 0
    assert pipeline(_SharedAct(), mb_args=(x,), split_spec=split.split_spec()).num_stages == 2


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 7), st.data())
def test_monotone_stages_is_the_exact_optimum(stages, units, data):
    import itertools

    from devplace.runtime.export import _monotone_stages

    cost = np.asarray(data.draw(st.lists(st.lists(st.integers(0, 9), min_size=units, max_size=units),
                                         min_size=stages, max_size=stages)), dtype=np.float64)
    got = _monotone_stages(cost)
    assert got == sorted(got) and all(0 <= j < stages for j in got)
    best = min(sum(cost[j, u] for u, j in enumerate(seq))
               for seq in itertools.combinations_with_replacement(range(stages), units))
    assert sum(cost[j, u] for u, j in enumerate(got)) == best


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


def test_device_map_export_of_a_plan_without_a_model_to_rebuild_says_it_maps_modules_only(tmp_path):
    from devplace.app.with_torch import export_plan
    from test_runtime import _cnn

    model, inputs = _cnn()
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin")  # made in Python: no zoo or custom source
    p.save(tmp_path / "plan.json")
    doc, note = export_plan(tmp_path / "plan.json", "device-map")
    assert doc["complete"] is False and doc["module"] == "" and "modules only" in note
    assert doc["device_map"] == device_map(p.graph, p.placement, p.cluster).mapping
    with pytest.raises(DevplaceError, match="names no zoo or custom model"):
        export_plan(tmp_path / "plan.json", "device-map", trust_model=True)
    with pytest.raises(DevplaceError, match="belong to --format device-map"):
        export_plan(tmp_path / "plan.json", "json", trust_model=True)
    with pytest.raises(DevplaceError, match="one real device name per logical device"):  # was an IndexError
        export_plan(tmp_path / "plan.json", "device-map", "cuda:0")


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
    doc = json.loads(out)  # the zoo model rebuilt: every tensor mapped, in its own names (it wraps nothing)
    assert doc["complete"] is True and doc["module"] == ""
    covered = set(doc["device_map"])
    assert covered <= set(dict(_Tiny().named_modules())) | set(_Tiny().state_dict())
    assert all(_entry(doc["device_map"], n) in (0, 1) for n in _Tiny().state_dict())
    code, out, err = _cli(["export", str(plan_path), "--format", "json", "--devices", "cpu,cpu"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["devices"] == ["cpu", "cpu"]
    code, out, err = _cli(["export", str(plan_path), "--format", "onnx"], capsys, monkeypatch)
    assert code == 2 and "unknown export format" in err
    code, out, err = _cli(["run", "--plan", str(plan_path), "--devices", "cpu"], capsys, monkeypatch)
    assert code == 2 and "real device(s) were given" in err


def test_place_and_run_take_a_profiled_table_with_its_overheads(tiny_zoo, tmp_path, capsys, monkeypatch):
    from devplace.capture.profile import local_cpu_device
    from devplace.hardware.cost import CostTable, Overheads
    from devplace.runtime.plan import load_plan

    cpu = local_cpu_device()
    table = CostTable(device_kind=cpu.kind, device=cpu, overheads=Overheads(2e-5, 3e-3, 4e-4))  # ops: analytic
    table.save(tmp_path / "t.json")
    (tmp_path / "c.json").write_text(json.dumps({"format": "devplace.cluster/1", "name": "two", "link": {
        "bandwidth_Bps": 1e9}, "devices": [{"name": f"c{i}", "memory_bytes": 1e9, "speed": cpu.speed, "kind": cpu.kind,
                                            "peak_flops": cpu.peak_flops, "mem_bandwidth_Bps": cpu.mem_bandwidth_Bps}
                                           for i in range(2)]}))
    for cmd, plan_path in ((["place", "-c", str(tmp_path / "c.json")], tmp_path / "placed.json"),
                           (["run", "--devices", "cpu,cpu", "--steps", "1", "--warmup", "0", "--record",
                             str(tmp_path / "r.jsonl")], tmp_path / "ran.json")):
        code, _, err = _cli([*cmd, "--model", tiny_zoo, "--placer", "round-robin", "--costs", str(tmp_path / "t.json"),
                             "--save-plan", str(plan_path)], capsys, monkeypatch)
        assert code == 0, err
        p = load_plan(plan_path)
        assert [d.action_s for d in p.cluster.devices] == [3e-3, 3e-3]
        assert p.cluster.latency[0, 1] == 4e-4 and p.graph.meta["cost"]["op_overhead_s"] == 2e-5
    code, _, err = _cli(["run", "--plan", str(tmp_path / "ran.json"), "--costs", str(tmp_path / "t.json")], capsys,
                        monkeypatch)
    assert code == 2 and "--costs are for --model" in err
    # a table of another device kind than the cluster's is refused (before the capture: check_table_fits)
    code, _, err = _cli(["place", "--model", tiny_zoo, "-c", "2xK80", "--costs", str(tmp_path / "t.json")], capsys,
                        monkeypatch)
    assert code == 2 and f"measured on {cpu.kind!r}" in err and "2xK80" in err


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
    with pytest.raises(FormatError, match=":3: not valid JSON"):
        read_runs(path)


# ------------------------------------------------------------------------------------------ exports of real models
def _gpt2() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from devplace.zoo.models import CausalLMLoss, _transformers

    tf = _transformers()
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
                        attn_implementation="sdpa")
    return CausalLMLoss(tf.GPT2LMHeadModel(cfg)), (torch.randint(0, 96, (2, 8)),)


def _llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from devplace.zoo.models import CausalLMLoss, _transformers

    tf = _transformers()
    # the zoo's llama-1b (grouped-query attention, SwiGLU, RoPE, tied embeddings) at a tiny size
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_act="silu",
                         max_position_embeddings=64, tie_word_embeddings=True, rope_theta=500000.0,
                         attention_dropout=0.0, bos_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    return CausalLMLoss(tf.LlamaForCausalLM(cfg)), (torch.randint(0, 96, (2, 8)),)


def _vit() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from torchvision.models.vision_transformer import VisionTransformer

    from devplace.zoo.models import ClassifierLoss

    # vit_b_16's architecture (class token, position embedding) at a tiny size
    vit = VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                            num_classes=10)
    nn.init.normal_(vit.heads.head.weight, std=0.5)  # torchvision zeroes the head: the loss would be log(10) always
    return ClassifierLoss(vit), (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))


def _swin() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from torchvision.models.swin_transformer import SwinTransformer

    from devplace.zoo.models import ClassifierLoss

    swin = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[2, 2],
                           stochastic_depth_prob=0.0, num_classes=10)
    return ClassifierLoss(swin), (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))


def _bart() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from devplace.zoo.models import LabelledLoss, _transformers

    tf = _transformers()
    # BART-base's structure (shared embedding tied four ways, final_logits_bias buffer) at a tiny size
    cfg = tf.BartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    model = tf.BartForConditionalGeneration(cfg)
    return LabelledLoss(model, use_cache=False), (torch.randint(3, 96, (2, 8)), torch.randint(3, 96, (2, 8)))


MODELS = {"gpt2": _gpt2, "llama": _llama, "vit": _vit, "swin": _swin, "bart": _bart}


def _build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, inputs = MODELS[name]()
    return model.train(), inputs


def _entry(mapping: dict[str, int], name: str) -> int:
    """The device of the innermost entry of a device_map covering tensor `name`."""
    return next(mapping[k] for k in sorted(mapping, key=len, reverse=True)
                if k == "" or name == k or name.startswith(k + "."))


@pytest.fixture(scope="module", params=sorted(MODELS))
def placed_model(request):
    """A tiny model, its inputs and a placer's plan on three devices (round-robin: as far from a pipeline or a
    module map as a placement gets, so every approximation is exercised)."""
    model, inputs = _build(request.param)
    return request.param, model, inputs, plan(model, inputs, "3xGPU-placeto", placer="round-robin", order="topo")


def test_pipeline_split_of_placer_output_builds_torch_pipeline_stages(placed_model):
    from torch.distributed.pipelining import pipeline

    name, model, inputs, p = placed_model
    split = pipeline_split(p.graph, p.placement, p.cluster, model)
    # round-robin spreads every block over the 3 devices; the nearest pipeline may leave a device out
    assert len(split.devices) in (2, 3) and len(split.split_points) == len(split.devices) - 1
    assert split.slowdown is not None and split.slowdown > 0
    # torch.distributed.pipelining splits a fresh copy (pipeline() annotates the module it is given)
    fresh, _ = _build(name)
    pipe = pipeline(fresh, mb_args=inputs, split_spec=split.split_spec())
    assert pipe.num_stages == len(split.devices)
    # the stages run, in one process, and compute the model's loss (dropout is off in these configs)
    with torch.no_grad():
        (out,) = pipe(*inputs)
        assert torch.allclose(out, model(*inputs), atol=1e-6)


def test_device_map_of_placer_output_loads_with_accelerate(placed_model, tmp_path):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from accelerate.utils import check_device_map, find_tied_parameters

    from devplace.runtime.apply import state_first_ops

    name, model, inputs, p = placed_model
    dm = device_map(p.graph, p.placement, p.cluster, model, inputs)
    # every parameter and buffer of the state_dict is covered (accelerate raises otherwise)
    check_device_map(model, dm.named(["cpu", "cpu", "cpu"]))

    def entry(name: str) -> int:
        return _entry(dm.mapping, name)

    tied = find_tied_parameters(model)
    assert tied or name not in ("gpt2", "llama", "bart")
    for group in tied:  # tied weights on one device
        assert len({entry(t) for t in group}) == 1, group
    # every tensor lives where the op that first reads it runs under the map (else accelerate's hooks would
    # hand that op a tensor on another device)
    first = state_first_ops(model, inputs)
    canonical = {id(t): n for n, t in reversed([*model.named_parameters(), *model.named_buffers()])}
    for n, t in model.state_dict(keep_vars=True).items():
        op = first.get(canonical[id(t)])
        if op is not None:
            assert entry(n) == dm.placement.assignment[op], n
    assert math.isfinite(dm.slowdown) and dm.slowdown > 0
    # loaded for real: the checkpoint into an empty (meta) model, each tensor to its map entry's device, with
    # accelerate's hooks on every mapped module (all on the CPU here); no tensor left behind, the same loss
    ckpt = tmp_path / "model.bin"
    torch.save(model.state_dict(), ckpt)
    with init_empty_weights():
        empty, _ = _build(name)
    loaded = load_checkpoint_and_dispatch(empty, str(ckpt), device_map=dm.named(["cpu", "cpu", "cpu"]),
                                          force_hooks=True)
    assert hasattr(loaded, "_hf_hook")
    assert not [n for n, t in loaded.state_dict().items() if t.device.type == "meta"]
    with torch.no_grad():
        assert torch.allclose(loaded(*inputs), model(*inputs), atol=1e-6)


@pytest.fixture
def tiny_bart_zoo(monkeypatch):
    """The tiny BART of `_bart` as zoo model "tiny-bart" (so that a saved plan names a model to rebuild)."""
    from devplace.zoo import models

    def factory(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return _bart()

    monkeypatch.setitem(models.MODELS, "tiny-bart", models.ModelSpec("tiny-bart", factory, 2, 8, 0, "tiny BART",
                                                                     "transformers"))
    return "tiny-bart"


def test_cli_device_map_rebuilds_the_model_and_loads_in_accelerate_and_transformers(tiny_bart_zoo, tmp_path, capsys,
                                                                                   monkeypatch):
    from accelerate import dispatch_model, init_empty_weights, load_checkpoint_and_dispatch
    from accelerate.utils import check_device_map, find_tied_parameters

    from devplace.capture.custom import build_named_model

    plan_path, dm_path = tmp_path / "plan.json", tmp_path / "dm.json"
    code, _, err = _cli(["place", "--model", tiny_bart_zoo, "-c", "3xGPU-placeto", "--placer", "round-robin",
                         "--order", "topo", "--save-plan", str(plan_path)], capsys, monkeypatch)
    assert code == 0, err
    code, out, err = _cli(["export", str(plan_path), "--format", "device-map", "-o", str(dm_path)], capsys,
                          monkeypatch)
    assert code == 0, err
    assert "cover every parameter and buffer of the wrapped model 'model'" in out + err
    doc = json.loads(dm_path.read_text())
    assert doc["complete"] is True and doc["module"] == "model"
    dm = doc["device_map"]
    assert len(set(dm.values())) > 1  # round-robin over 3 devices: a real split, not one device
    wrapper, inputs, _ = build_named_model(tiny_bart_zoo, seed=0)
    hf = wrapper.model  # the Hugging Face model itself: the map is in its own names (no "model." wrapper prefix)
    check_device_map(hf, dm)  # every parameter and buffer covered: shared.weight, final_logits_bias included

    tied = find_tied_parameters(hf)
    assert tied and all(len({_entry(dm, t) for t in group}) == 1 for group in tied)  # tied weights on one device
    cpu = {k: "cpu" for k in dm}
    with torch.no_grad():
        reference = float(wrapper(*inputs))
        ids, labels = inputs
        # from_pretrained on the tiny config saved locally
        hf.save_pretrained(tmp_path / "tiny")
        loaded = type(hf).from_pretrained(tmp_path / "tiny", device_map=cpu)
        assert float(loaded(input_ids=ids, labels=labels, use_cache=False).loss) == pytest.approx(reference, rel=1e-6)
        # dispatch_model of the model in memory
        again, _, _ = build_named_model(tiny_bart_zoo, seed=0)
        dispatched = dispatch_model(again.model, cpu, force_hooks=True)
        assert float(dispatched(input_ids=ids, labels=labels, use_cache=False).loss) == pytest.approx(reference,
                                                                                                     rel=1e-6)
        # load_checkpoint_and_dispatch into an empty model
        torch.save(hf.state_dict(), tmp_path / "model.bin")
        with init_empty_weights():
            empty, _, _ = build_named_model(tiny_bart_zoo, seed=0)
        ckpt = load_checkpoint_and_dispatch(empty.model, str(tmp_path / "model.bin"), device_map=cpu, force_hooks=True)
        assert not [n for n, t in ckpt.state_dict().items() if t.device.type == "meta"]
        assert float(ckpt(input_ids=ids, labels=labels, use_cache=False).loss) == pytest.approx(reference, rel=1e-6)
    # the export reads back as a hand-made map of the captured (wrapped) model: its names under "model." again
    code, out, err = _cli(["place", "--model", tiny_bart_zoo, "-c", "3xGPU-placeto", "--map", str(dm_path), "--json"],
                          capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["step_time_s"] == pytest.approx(doc["step_time_s"], rel=1e-9)


def test_module_level_map_alone_misses_tensors_that_accelerate_needs():
    from accelerate.utils import check_device_map

    model, inputs = _build("vit")
    p = plan(model, inputs, "3xGPU-placeto", placer="round-robin", order="topo")
    partial = device_map(p.graph, p.placement, p.cluster)
    full = device_map(p.graph, p.placement, p.cluster, model, inputs)
    with pytest.raises(ValueError, match="class_token"):
        check_device_map(model, partial.named(["cpu", "cpu", "cpu"]))
    assert "model.class_token" in full.mapping


def test_peers_cache_key_follows_the_capturing_code(tmp_path, monkeypatch):
    """benchmarks/peers.py --cache: a capture file is named by its settings and by the code that captures
    (devplace's capture and graph modules, torch's and transformers' versions), so a changed capture is made anew
    instead of read from an old file."""
    import sys

    spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "peers", mod)
    spec.loader.exec_module(mod)
    first = mod.capture_file(tmp_path, "pkg.mod:factory", 8, 2)
    assert first == mod.capture_file(tmp_path, "pkg.mod:factory", 8, 2) and first.parent == tmp_path
    assert first != mod.capture_file(tmp_path, "pkg.mod:factory", 8, 4)
    code = mod.capture_code()
    assert torch.__version__.encode() in code and b"def capture" in code
    monkeypatch.setattr(mod, "capture_code", lambda: code + b"# an edit")
    assert mod.capture_file(tmp_path, "pkg.mod:factory", 8, 2) != first
