"""A dp x pp parallel export run for real (issue 31 item 4): 2 replicas of a 2-stage pipeline in 4 CPU processes
over gloo, with ZeRO-1 and activation checkpointing of its first block on one stage, FSDP (ZeRO-3) and per-block
checkpointing on the other; the loss and every gradient match the one-process step. Also reading exports back
and the runner's refusals."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import run_cli
from devplace.graph.parallel import ParallelPlan
from devplace.runtime.export import ExportError
from devplace.runtime.parallel_export import data_parallel_of, parallel_export, read_parallel, torchtitan_config
from devplace.runtime.parallel_run import checkpoint_blocks, run_parallel
from devplace.runtime.pipeline_run import PipelineRunError
from devplace.runtime.plan import build_source


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(F.gelu(self.a(h)))


class _Net(nn.Module):
    """Four numbered blocks (`blocks.i`, what recomputation checkpoints) between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(_Block(16) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h), labels)


def _net() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return _Net(), (torch.randn(8, 6), torch.randint(0, 3, (8,)))


def test_two_replicas_of_two_stages_with_zero_fsdp_and_recomputation_match_the_one_process_step():
    """Loss and every gradient of the first step, then the loss after the SGD update (ZeroRedundancyOptimizer on
    stage 0, fully_shard's sharded update on stage 1)."""
    model, inputs = _net()
    plan = ParallelPlan(dp=2, pp=2, microbatches=2, batch=8, schedule="1f1b", zero=(1, 3), recompute=(1, "full"))
    ran = run_parallel(model, inputs, parallel_export(plan, ["blocks.2"]), steps=2, optimizer="sgd",
                       return_grads=True)
    assert ran.processes == 4 and len(ran.step_times_s) == 2
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, foreach=False)  # as run_steps sets it up
    loss = ref(*inputs)
    loss.backward()
    assert sorted(ran.grads) == sorted(n for n, _ in ref.named_parameters())
    for name, param in ref.named_parameters():
        torch.testing.assert_close(ran.grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    first = loss.item()
    opt.step()
    assert ran.losses == pytest.approx([first, ref(*inputs).item()], rel=1e-5)
    # each replica saw its own half of the batch: their losses differ, their mean is the batch's
    assert ran.replica_losses[0] != pytest.approx(ran.replica_losses[1], rel=1e-3)
    # process r * pp + s ran stage s of replica r as the plan says
    for r in range(2):
        zero1, fsdp = ran.setups[2 * r], ran.setups[2 * r + 1]
        assert zero1 == {"checkpointed": ["blocks.0"], "optimizer": "ZeroRedundancyOptimizer",  # its first block
                         "sharded": False}
        assert fsdp == {"checkpointed": ["blocks.2", "blocks.3"], "optimizer": "SGD", "sharded": True}
    assert all(p.grad is None for p in model.parameters())  # the module itself is left as it was


def test_pure_data_parallel_with_zero_2_and_a_summed_loss():
    """One stage (schedule "none": the micro-batches one after another) in 2 replicas, fully_shard without
    resharding after forward, the loss taken as a sum (`loss_reduction="sum"`): the 2 x 2 micro-batch losses (each
    the mean over its 2 samples) and their gradients are summed, 4 times the one-process mean's."""
    model, inputs = _net()
    plan = ParallelPlan(dp=2, pp=1, microbatches=2, batch=8, schedule="none", zero=2)
    ran = run_parallel(model, inputs, parallel_export(plan, []), steps=1, loss_reduction="sum", return_grads=True)
    ref = copy.deepcopy(model)
    loss = ref(*inputs)
    loss.backward()
    assert ran.losses == pytest.approx([4 * loss.item()], rel=1e-5)
    for name, param in ref.named_parameters():
        torch.testing.assert_close(ran.grads[name], 4 * param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert [s["sharded"] for s in ran.setups] == [True, True]


def test_checkpointed_blocks_rerun_their_forward_in_the_backward():
    model, inputs = _net()
    calls: list[str] = []
    for i, block in enumerate(model.blocks):
        block.a.register_forward_hook(lambda *_, i=i: calls.append(f"blocks.{i}"))
    plain = torch.autograd.grad(model(*inputs), list(model.parameters()))
    assert calls == [f"blocks.{i}" for i in range(4)]
    assert checkpoint_blocks(model) == [f"blocks.{i}" for i in range(4)]
    calls.clear()
    again = torch.autograd.grad(model(*inputs), list(model.parameters()))
    assert sorted(calls) == sorted(2 * [f"blocks.{i}" for i in range(4)])  # each block's forward twice
    for g, h in zip(plain, again, strict=True):
        torch.testing.assert_close(g, h)
    # a module without numbered blocks (a Sequential's children are not layers of a stack) is one unit
    assert checkpoint_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == [""]
    # a number of blocks: the first ones; none where a module has no blocks
    assert checkpoint_blocks(_net()[0], 3) == [f"blocks.{i}" for i in range(3)]
    assert checkpoint_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 2) == []


def test_the_program_configuration_per_stage():
    plan = ParallelPlan(dp=2, pp=2, microbatches=2, batch=8, zero=(1, 3), recompute=("full", "none"))
    doc = parallel_export(plan, ["blocks.2"], source={"zoo": "x", "batch": 8})
    assert [st["data_parallel"] for st in doc["stages"]] == [data_parallel_of(1, 2), data_parallel_of(3, 2)]
    assert doc["stages"][0]["data_parallel"] == {"wrapper": "DistributedDataParallel",
                                                 "optimizer": "ZeroRedundancyOptimizer"}
    assert doc["stages"][1]["data_parallel"] == {"wrapper": "fully_shard", "reshard_after_forward": True,
                                                 "optimizer": "local"}
    assert data_parallel_of(2, 2)["reshard_after_forward"] is False and data_parallel_of(0, 1)["wrapper"] == "none"
    assert [st["activation_checkpointing"] for st in doc["stages"]] == ["per block", "none"]
    partial = replace(plan, recompute=(2, 2))
    assert [st["activation_checkpointing"] for st in parallel_export(partial, ["blocks.2"])["stages"]] == \
        ["first 2 blocks"] * 2
    assert read_parallel(parallel_export(partial, ["blocks.2"])).plan == partial
    with pytest.raises(ExportError, match="not a stage's first 2 blocks as this plan does; export it with --format "
                                          "parallel"):
        torchtitan_config(read_parallel(parallel_export(replace(partial, zero=1), ["blocks.2"])))
    assert [st["devices"] for st in doc["stages"]] == [list(plan.stage_group(0)), list(plan.stage_group(1))]
    back = read_parallel(doc)
    assert back.plan == plan and back.split_points == ("blocks.2",) and back.source == {"zoo": "x", "batch": 8}
    # torchtitan applies one data-parallel mode and one checkpointing policy to all stages (test_torchtitan_export
    # checks its sections against torchtitan's classes where the extra is installed)
    with pytest.raises(ExportError, match="one ZeRO stage and one recomputation"):
        torchtitan_config(back)


def test_bad_exports_and_runs_are_clear_errors(tmp_path):
    model, inputs = _net()
    plan = ParallelPlan(dp=2, pp=2, microbatches=2, batch=8)
    doc = parallel_export(plan, ["blocks.2"])
    with pytest.raises(ExportError, match="cut at 1 distinct"):
        parallel_export(plan, [])
    for broken, says in [({"format": "devplace.pipeline/2"}, "devplace.parallel/2"),
                         ({"parallel": {**doc["parallel"], "dp": 3}}, "do not split the batch"),
                         ({"split_points": [{"module": "blocks.2", "point": "end"}]}, "beginning"),
                         ({"split_points": []}, "needs 1 distinct split point"),
                         ({"source": "zoo"}, "source must be an object")]:
        with pytest.raises(ExportError, match=says):
            read_parallel({**doc, **broken})
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ExportError, match=r"bad\.json"):
        read_parallel(path)
    with pytest.raises(PipelineRunError, match="not modules of"):
        run_parallel(model, inputs, parallel_export(plan, ["nowhere"]))
    with pytest.raises(PipelineRunError, match="at least as many micro-batches as stages"):
        run_parallel(model, inputs, parallel_export(ParallelPlan(dp=2, pp=2, microbatches=1, batch=8), ["blocks.2"]))
    with pytest.raises(PipelineRunError, match="under one of gpipe, 1f1b"):
        run_parallel(model, inputs, parallel_export(ParallelPlan(dp=2, pp=2, microbatches=2, batch=8,
                                                                 schedule="interleaved-1f1b"), ["blocks.2"]))
    with pytest.raises(PipelineRunError, match="4 equal micro-batches"):  # dp * M pieces of a batch of 6
        run_parallel(model, (inputs[0][:6], inputs[1][:6]), doc)
    with pytest.raises(PipelineRunError, match="position 0 recomputes 3 blocks but its stages hold 2 numbered "
                                               "blocks; give at most 2"):
        run_parallel(model, inputs, parallel_export(ParallelPlan(dp=2, pp=2, microbatches=2, batch=8,
                                                                 recompute=(3, "none")), ["blocks.2"]))


class _TiedNet(nn.Module):
    """Tokens -> an embedding, four blocks, an output layer tied to the embedding (as GPT-2's `lm_head` is to
    `wte`): the pipeline's first and last stage each hold a copy of the one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.blocks = nn.ModuleList(_Block(16) for _ in range(4))
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h), labels)


def _tied(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _TiedNet(), (torch.randint(0, 10, (batch,)), torch.randint(0, 10, (batch,)))


@pytest.fixture
def net_zoo(monkeypatch):
    from devplace.zoo import models

    spec = models.ModelSpec("net-test", _tied, 8, None, 2000, "four blocks, tied embeddings, for tests", "devplace")
    monkeypatch.setitem(models.MODELS, "net-test", spec)
    return "net-test"


def test_cli_exports_a_pipelined_plan_as_a_parallel_plan_and_runs_it(net_zoo, tmp_path, capsys, monkeypatch):
    """`place --save-plan` (a 2-stage pipeline) -> `export --format parallel --dp 2 --zero 1 --recompute full` ->
    `run --parallel`: 4 processes whose losses over two Adam steps are the one-process step's (the tied
    parameter's gradient summed over its copies in the two stages, then averaged over the replicas);
    `--format torchtitan` of the same."""

    plan_path, par_path = tmp_path / "plan.json", tmp_path / "par.json"
    code, _, err = run_cli(["place", "--model", net_zoo, "-c", "2xK80", "--placer", "pipeline", "--schedule", "1f1b",
                            "--microbatches", "2", "--save-plan", str(plan_path)], capsys, monkeypatch)
    assert code == 0, err
    code, out, err = run_cli(["export", str(plan_path), "--format", "parallel", "--dp", "2", "--zero", "1",
                              "--recompute", "full", "-o", str(par_path)], capsys, monkeypatch)
    assert code == 0, err
    ex = read_parallel(par_path)
    assert ex.plan.dp == 2 and ex.plan.pp == 2 and ex.plan.microbatches == 2 and ex.plan.batch == 8
    assert ex.plan.zero == (1, 1) and ex.plan.recompute == ("full", "full") and ex.source["zoo"] == net_zoo
    code, out, err = run_cli(["run", "--parallel", str(par_path), "--steps", "2", "--warmup", "0", "--json"], capsys,
                             monkeypatch)
    assert code == 0, err
    ran = json.loads(out)
    assert ran["processes"] == 4 and ran["parallel"] == ex.plan.to_dict()
    model, inputs, _ = build_source(ex.source)  # the model the run rebuilt, stepped in one process
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)  # as run_steps sets it up
    loss = model(*inputs)
    loss.backward()
    opt.step()
    assert ran["losses"] == pytest.approx([loss.item(), model(*inputs).item()], rel=1e-5)
    assert ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)
    assert [s["optimizer"] for s in ran["processes_setup"]] == ["ZeroRedundancyOptimizer"] * 4
    code, out, err = run_cli(["export", str(plan_path), "--format", "torchtitan", "--dp", "2", "--zero", "3"], capsys,
                             monkeypatch)
    assert code == 0, err
    titan = json.loads(out)
    assert titan["parallelism"]["data_parallel_shard_degree"] == 2 and titan["activation_checkpoint"] == "none"
    for bad, says in [(["export", str(plan_path), "--format", "json", "--dp", "2"], "--dp, --zero and --recompute"),
                      (["export", str(plan_path), "--format", "parallel", "--dp", "3"], "dp=3 replicas"),
                      (["export", str(plan_path), "--format", "parallel", "--zero", "1"], "dp=1 has none"),
                      (["export", str(plan_path), "--format", "parallel", "--dp", "0"], "dp must be an integer >= 1"),
                      (["export", str(plan_path), "--format", "torchtitan", "--dp", "2", "--zero", "7"],
                       "zero must be one of 0, 1, 2, 3"),
                      (["export", str(plan_path), "--format", "parallel", "--recompute", "half"],
                       "recompute must be one of none, full"),
                      (["run", "--parallel", str(par_path), "--threads", "2"], "--threads 2"),
                      (["export", str(plan_path), "--format", "parallel", "--devices", "cpu,cpu"], "drop --devices"),
                      (["run", "--parallel", str(par_path), "--plan", str(plan_path)], "--parallel runs an export"),
                      (["run", "--parallel", str(plan_path)], "devplace.parallel/2")]:
        code, _, err = run_cli(bad, capsys, monkeypatch)
        assert code == 2 and says in err and err.count("\n") == 1, (bad, err)


TOWER = """
import torch
from torch import nn


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.stem(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


def build(batch=8):
    torch.manual_seed(0)
    return Tower(), torch.randn(batch, 16)
"""


def test_a_plan_placed_as_a_parallel_plan_exports_the_plan_its_search_chose(python_package, tmp_path, capsys,
                                                                           monkeypatch):
    """`place --dp 2 --zero 1 --recompute full --save-plan` records the searched plan; `export --format parallel`
    writes that one (flags that would change it are refused); `run --parallel` runs it (2 replicas of one stage,
    ZeRO-1, recomputation; `run --plan` of the plan itself: tests/test_parallel_search.py)."""
    tower = python_package("ptower_pkg", TOWER) + ":build"
    plan_path, par_path = tmp_path / "plan.json", tmp_path / "par.json"
    code, out, err = run_cli(["place", "--model", tower, "-c", "2xK80", "--dp", "2", "--zero", "1", "--recompute",
                              "full", "--json", "--save-plan", str(plan_path)], capsys, monkeypatch)
    assert code == 0, err
    chosen = json.loads(out)["parallel"]["plan"]
    code, out, err = run_cli(["export", str(plan_path), "--format", "parallel", "-o", str(par_path)], capsys,
                             monkeypatch)
    assert code == 0, err
    ex = read_parallel(par_path)
    assert ex.plan.to_dict() == chosen and ex.source["custom"] == tower
    assert ex.source["batch"] == ex.plan.batch == 8  # the model's batch, not a replica's (the graph's capture)
    assert "(the search's)" in " ".join((out + err).split())
    code, _, err = run_cli(["export", str(plan_path), "--format", "parallel", "--dp", "2"], capsys, monkeypatch)
    assert code == 2 and "drop --dp" in err
    for fmt in ("pipeline", "json"):  # replica 0 alone would drop the replicas, ZeRO and recomputation
        code, _, err = run_cli(["export", str(plan_path), "--format", fmt], capsys, monkeypatch)
        assert code == 2 and "--format parallel" in err and err.count("\n") == 1, (fmt, err)
    # the tower returns no loss: its step's loss is the sum of its outputs, so the replicas' losses and
    # gradients are summed, not averaged
    code, out, err = run_cli(["run", "--parallel", str(par_path), "--trust-model", "--steps", "1", "--warmup", "0",
                              "--json"], capsys, monkeypatch)
    assert code == 0, err
    ran = json.loads(out)
    assert ran["processes"] == 2 and ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)
    assert ran["dropout_masks_differ"] is False and ran["batching_changes_result"] is False
    assert ran["losses"][0] == pytest.approx(sum(ran["replica_losses"]), rel=1e-6)


def test_a_run_says_when_dropout_or_batchnorm_make_its_loss_differ():
    """Active dropout (each process draws its own masks) and training-mode BatchNorm (each micro-batch or replica
    normalised by its own statistics) are named as why a run's loss differs from the one-process step's."""
    from devplace.app.with_torch import _random_or_batched, _why_losses_differ

    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.BatchNorm1d(4), nn.Dropout(0.0))
    assert _random_or_batched(net) == (True, True)
    assert _random_or_batched(net.eval()) == (False, False)
    assert _random_or_batched(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)).train()) == (False, False)
    assert "dropout" in _why_losses_differ(False, True, "micro-batch") and _why_losses_differ(False, False, "x") == ""
