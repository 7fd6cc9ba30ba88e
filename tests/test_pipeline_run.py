"""A pipeline export run for real: `devplace.runtime.run_pipeline` builds torch.distributed.pipelining stages
from a `devplace.pipeline/3` export and runs them in CPU processes with gloo; the loss and every parameter
gradient match the unpipelined step. Also the export's schedule, reading exports back, and `devplace run
--pipeline`."""

from __future__ import annotations

import copy
import json
import os
import signal
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import run_cli as _cli
from devplace.runtime import plan
from devplace.runtime.export import ExportError, PipelineSplit, callable_modules, pipeline_split, read_pipeline
from devplace.runtime.module_map import placement_from_module_map
from devplace.runtime.pipeline_run import TIMELINE_OTHER, PipelineRunError, run_pipeline
from devplace.sim import simulate
from devplace.sim.schedule import FORWARD, Schedule, ScheduleError, actions

BATCH = 8


class _LM(nn.Module):
    """A tiny GPT-2 with tied embeddings, zoo-style: input_ids -> its own next-token loss (labels = inputs, so
    the last stage reads a model input)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
        self.model = GPT2LMHeadModel(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


class _CNN(nn.Module):
    """A small CNN (no batch norm: its statistics are per micro-batch), zoo-style: images, labels -> loss."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.block1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(16, 5)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.block2(self.block1(self.stem(images))).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h), labels)


def _build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    if name == "gpt2":
        return _LM(), (torch.randint(0, 64, (BATCH, 8)),)
    return _CNN(), (torch.randn(BATCH, 3, 8, 8), torch.randint(0, 5, (BATCH,)))


# split points (module names of the captured model) for 2 and 4 stages
SPLITS = {"gpt2": {2: ["model.transformer.h.1"],
                   4: ["model.transformer.h.0", "model.transformer.h.1", "model.transformer.ln_f"]},
          "cnn": {2: ["block1"], 4: ["block1", "block2", "head"]}}


@pytest.fixture(scope="module", params=["gpt2", "cnn"])
def planned(request):
    model, inputs = _build(request.param)
    return request.param, model, inputs, plan(model, inputs, "4xV100-16GB", placer="single")


def _export(name, model, p, stages: int, schedule: Schedule) -> dict:
    """The devplace.pipeline/3 document of the pipeline placement cut at SPLITS[name][stages], via JSON text."""
    placement = placement_from_module_map(p.graph, p.cluster, SPLITS[name][stages])
    split = pipeline_split(p.graph, placement, p.cluster, model, schedule=schedule)
    assert split.split_points == tuple(SPLITS[name][stages]) and split.moved_fraction == 0.0
    assert split.pipelined_step_time_s is not None and split.pipelined_step_time_s > 0
    return json.loads(json.dumps(split.to_dict()))


def timeline_holds(ran, compute: list[list[str]]) -> None:
    """Each process's timeline of each step (`PipelineRun.timelines`) names the compute actions `compute[r]`
    (process r's, in the order it ran them), each once, between the waits and losses, and ends with the update;
    spans in start order within the step, CPU seconds no more than their wall seconds allow on one thread."""
    assert len(ran.timelines) == ran.processes
    for r, steps in enumerate(ran.timelines):
        assert len(steps) == len(ran.step_times_s)
        for spans, step_s in zip(steps, ran.step_times_s, strict=True):
            names = [w for w, *_ in spans]
            assert [w for w in names if w not in TIMELINE_OTHER] == compute[r]
            assert names[-1] == "update" and names.count("update") == 1
            starts = [a for _, a, _, _ in spans]
            assert starts == sorted(starts)
            for _, a, b, cpu in spans:
                assert 0 <= a <= b <= step_s + 1e-9 and 0 <= cpu <= (b - a) + 1e-3


def single_stage_actions(schedule: Schedule, stages: int, stage: int) -> list[str]:
    """The compute actions devplace simulates on `stage` of a one-chunk schedule (`sim.schedule.actions`), as torch
    names them ("0F1", "0B1")."""
    return [f"{stage}{'F' if phase == FORWARD else 'B'}{mb}" for phase, _, mb in actions(schedule, stages, stage)]


# (stages, schedule, micro-batches): each model on 2 and 4 stages, under both schedules
CASES = {"gpt2": [(2, "gpipe", 2), (4, "1f1b", 4)], "cnn": [(2, "1f1b", 2), (4, "gpipe", 4)]}


@pytest.mark.parametrize("case", [0, 1])
def test_pipelined_steps_match_the_unpipelined_steps(planned, case):
    """Loss and every parameter gradient of the first step, then the loss after an SGD update."""
    name, model, inputs, p = planned
    stages, kind, microbatches = CASES[name][case]
    doc = _export(name, model, p, stages, Schedule(kind, microbatches))
    ex = read_pipeline(doc)
    assert ex.schedule == Schedule(kind, microbatches) and ex.num_stages == stages
    ran = run_pipeline(model, inputs, ex, steps=2, optimizer="sgd", return_grads=True)
    assert ran.processes == stages and len(ran.step_times_s) == 2 and ran.step_time_s > 0
    timeline_holds(ran, [single_stage_actions(ex.schedule, stages, r) for r in range(stages)])
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, foreach=False)  # as run_steps/the capture set it up
    loss = ref(*inputs)
    loss.backward()
    first = loss.item()
    names = [n for n, _ in ref.named_parameters(remove_duplicate=False)]
    if name == "gpt2":  # tied: one tensor, two names, in the first and the last stage
        assert "model.lm_head.weight" in names and "model.transformer.wte.weight" in names
    for n, param in ref.named_parameters(remove_duplicate=False):
        assert n in ran.grads, n
        assert torch.allclose(ran.grads[n], param.grad, rtol=1e-4, atol=1e-6), n
    opt.step()
    opt.zero_grad()
    assert ran.losses == pytest.approx([first, ref(*inputs).item()], rel=1e-5)
    # the module itself is left as it was (the runner splits a copy)
    assert all(param.grad is None for param in model.parameters())


def test_bad_exports_and_inputs_are_clear_errors(planned, tmp_path):
    name, model, inputs, p = planned
    doc = _export(name, model, p, 2, Schedule("1f1b", 2))
    for broken, says in [({"format": "devplace.pipeline/1"}, "devplace.pipeline/3"),
                         ({"schedule": None}, "schedule"),
                         ({"schedule": {"kind": "zigzag", "microbatches": 2}}, "unknown schedule kind"),
                         ({"schedule": {"kind": "interleaved-1f1b", "microbatches": 4, "chunks": 2}}, "stage s mod p"),
                         ({"stage_devices": [0]}, "stage_devices"),
                         ({"split_points": [{"module": "x", "point": "end"}]}, "beginning")]:
        with pytest.raises(ExportError, match=says):
            read_pipeline({**doc, **broken})
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ExportError, match=r"bad\.json"):
        read_pipeline(path)
    with pytest.raises(PipelineRunError, match="3 equal micro-batches"):
        run_pipeline(model, inputs, {**doc, "schedule": Schedule("1f1b", 3).to_dict()})
    with pytest.raises(PipelineRunError, match="runs in 2 processes"):
        run_pipeline(model, inputs, doc, processes=3)
    with pytest.raises(PipelineRunError, match=r"at least as many micro-batches as stages: 2 micro-batch.* 4 stages"):
        run_pipeline(model, inputs, _export(name, model, p, 4, Schedule("1f1b", 2)))
    with pytest.raises(PipelineRunError, match="not modules of"):
        run_pipeline(model, inputs, {**doc, "split_points": [{"module": "nowhere", "point": "beginning"}]})


class _Branchy(nn.Module):
    """Data-dependent control flow: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h).mean()


def _failing_loss(output: torch.Tensor) -> torch.Tensor:
    raise ValueError("no loss here")


def test_a_failing_stage_shows_its_own_error_and_where(planned):
    """The last stage fails (its loss); the first then loses its peer: the error is the last stage's own."""
    name, model, inputs, p = planned
    if name != "cnn":
        pytest.skip("one model is enough")
    with pytest.raises(PipelineRunError, match=r"stage 1: ValueError: no loss here \(raised at File .*_failing_loss"):
        run_pipeline(model, inputs, _export(name, model, p, 2, Schedule("gpipe", 2)), loss_fn=_failing_loss)


def _killed_loss(output: torch.Tensor) -> torch.Tensor:
    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does to a process
    return output.sum()


def test_a_stage_killed_by_a_signal_is_named_with_a_hint(planned):
    """A stage process ended by SIGKILL (no traceback of its own) is a PipelineRunError naming the signal and
    suggesting memory, not torch's ProcessExitedException."""
    name, model, inputs, p = planned
    if name != "cnn":
        pytest.skip("one model is enough")
    with pytest.raises(PipelineRunError, match=r"stage process 1 ended by signal SIGKILL: out of memory\?"):
        run_pipeline(model, inputs, _export(name, model, p, 2, Schedule("gpipe", 2)), loss_fn=_killed_loss)


def test_an_untraceable_model_says_so_in_one_line():
    doc = {"format": "devplace.pipeline/2", "stage_devices": [0, 1],
           "split_points": [{"module": "b", "point": "beginning"}], "schedule": Schedule("gpipe", 2).to_dict()}
    with pytest.raises(PipelineRunError, match="cannot be split for pipelining") as err:
        run_pipeline(_Branchy(), (torch.randn(4, 4),), doc)
    assert "\n" not in str(err.value)


def test_export_carries_the_schedule_the_placement_was_made_for(planned):
    name, _, _, p = planned
    placement = placement_from_module_map(p.graph, p.cluster, SPLITS[name][2])
    # a placement made without a schedule: 1F1B, one micro-batch per stage
    assert pipeline_split(p.graph, placement, p.cluster).to_dict()["schedule"] == Schedule("1f1b", 2).to_dict()
    piped = replace(placement, schedule=Schedule("gpipe", 4))  # as `place` gives a pipeline placer's
    assert read_pipeline(pipeline_split(p.graph, piped, p.cluster).to_dict()).schedule == Schedule("gpipe", 4)
    with pytest.raises(ExportError, match="not 2 rounds of the same 2 devices"):  # one stage per device
        pipeline_split(p.graph, replace(placement, schedule=Schedule("interleaved-1f1b", 4, 2)), p.cluster)
    with pytest.raises(ScheduleError):
        Schedule("gpipe", 0)


@pytest.fixture
def cnn_zoo(monkeypatch):
    from devplace.zoo import models

    def factory(batch: int, seq_len: int | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return _CNN(), (torch.randn(batch, 3, 8, 8), torch.randint(0, 5, (batch,)))

    spec = models.ModelSpec("cnn-test", factory, BATCH, None, 2000, "a small CNN for tests", "devplace")
    monkeypatch.setitem(models.MODELS, "cnn-test", spec)
    return "cnn-test"


def test_cli_exports_a_plan_with_its_schedule_and_runs_it(cnn_zoo, tmp_path, capsys, monkeypatch):
    plan_path, export_path = tmp_path / "plan.json", tmp_path / "pipe.json"
    code, out, err = _cli(["run", "--model", cnn_zoo, "--devices", "cpu,cpu", "--placer", "round-robin",
                           "--steps", "1", "--warmup", "0", "--record", str(tmp_path / "runs.jsonl"),
                           "--save-plan", str(plan_path)], capsys, monkeypatch)
    assert code == 0, err
    code, out, err = _cli(["export", str(plan_path), "--format", "pipeline", "--schedule", "gpipe",
                           "--microbatches", "4", "-o", str(export_path)], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(export_path.read_text())
    # round-robin cuts inside modules: the export moves work to block starts and says so
    said = " ".join((out + err).split())  # the report wraps at the terminal's width
    assert doc["moved_fraction"] > 0 and f"moved {100 * doc['moved_fraction']:.1f}% of the forward work" in said
    assert doc["format"] == "devplace.pipeline/3" and doc["schedule"]["kind"] == "gpipe"
    assert doc["schedule"]["microbatches"] == 4 and doc["source"]["zoo"] == cnn_zoo
    stages = len(doc["stage_devices"])
    # issue 30: what `run` would refuse is refused by `export`, before anything runs
    for refused, says in [(["--microbatches", "3"], "does not split the plan's batch of 8"),
                          (["--schedule", "1f1b", "--microbatches", "1"], "at least as many micro-batches as stages")]:
        code, out, err = _cli(["export", str(plan_path), "--format", "pipeline", *refused, "-o",
                               str(tmp_path / "refused.json")], capsys, monkeypatch)
        assert code == 2 and says in " ".join(err.split()) and not (tmp_path / "refused.json").exists()
    code, out, err = _cli(["run", "--pipeline", str(export_path), "--steps", "1", "--warmup", "0", "--json"],
                          capsys, monkeypatch)
    assert code == 0, err
    ran = json.loads(out)
    assert ran["processes"] == stages and ran["schedule"]["kind"] == "gpipe"
    assert ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)
    # the timed step, action by action, per process: its forwards and backwards by name (GPipe)
    m = ran["schedule"]["microbatches"]
    assert [[w for w, *_ in step if w not in TIMELINE_OTHER] for [step] in ran["timelines"]] == [
        single_stage_actions(Schedule("gpipe", m), stages, r) for r in range(stages)]
    code, out, err = _cli(["run", "--pipeline", str(export_path), "--processes", str(stages + 1)], capsys,
                          monkeypatch)
    assert code == 2 and f"runs in {stages} processes" in err
    code, out, err = _cli(["run", "--pipeline", str(export_path), "--threads", "2"], capsys, monkeypatch)
    assert code == 2 and "1 thread" in err and "--threads 2" in err  # stages run 1 thread each
    code, out, err = _cli(["run", "--plan", str(plan_path), "--schedule", "gpipe", "--microbatches", "2",
                           "--threads", "2"], capsys, monkeypatch)
    assert code == 2 and "--schedule gpipe" in err and "1 thread" in err
    code, out, err = _cli(["export", str(plan_path), "--format", "json", "--schedule", "gpipe"], capsys, monkeypatch)
    assert code == 2 and "--format pipeline" in err


def test_a_placement_goes_from_place_to_export_and_run_through_files(cnn_zoo, tmp_path, capsys, monkeypatch):
    """Issue 23 item 3: `place --save-plan` writes a plan (placement, schedule, model, precision) that `export`
    and `run --plan` take; `place --map --schedule --microbatches` judges a hand split under a schedule; `run`
    takes --schedule/--microbatches and runs such a plan pipelined; a placement file is refused with the way on."""
    plan_path, placement_path = tmp_path / "plan.json", tmp_path / "placement.json"
    code, out, err = _cli(["place", "--model", cnn_zoo, "-c", "2xK80", "--placer", "pipeline", "--schedule", "gpipe",
                           "--microbatches", "2", "--save-plan", str(plan_path), "-o", str(placement_path), "--json"],
                          capsys, monkeypatch)
    assert code == 0, err
    placed = json.loads(out)
    plan = json.loads(plan_path.read_text())
    assert plan["format"] == "devplace.plan/1" and plan["settings"]["source"]["zoo"] == cnn_zoo
    assert plan["settings"]["source"]["batch"] == BATCH and plan["settings"]["dtype"] is None
    assert plan["placement"]["schedule"] == placed["schedule"] and placed["schedule"]["kind"] == "gpipe"
    for fmt in ("pipeline", "device-map"):
        code, out, err = _cli(["export", str(plan_path), "--format", fmt], capsys, monkeypatch)
        assert code == 0, err
    assert json.loads(out)["format"] == "devplace.device_map/1"
    code, _, err = _cli(["export", str(placement_path), "--format", "device-map"], capsys, monkeypatch)
    assert code == 2 and "--save-plan" in err and err.count("\n") == 1
    code, out, err = _cli(["run", "--plan", str(plan_path), "--steps", "1", "--warmup", "0", "--json"], capsys,
                          monkeypatch)
    assert code == 0, err
    ran = json.loads(out)  # a pipelined plan runs pipelined, under its own schedule
    assert ran["schedule"] == placed["schedule"]
    assert ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)
    # a hand split judged under a schedule, as the simulator judges the same placement
    split = tmp_path / "split.json"
    split.write_text(json.dumps(["block2"]))
    code, out, err = _cli(["place", "--model", cnn_zoo, "-c", "2xK80", "--map", str(split), "--schedule", "1f1b",
                           "--microbatches", "4", "--json"], capsys, monkeypatch)
    assert code == 0, err
    mapped = json.loads(out)
    assert mapped["schedule"]["kind"] == "1f1b" and mapped["schedule"]["microbatches"] == 4
    code, out, err = _cli(["place", "--model", cnn_zoo, "-c", "2xK80", "--map", str(split), "--json"], capsys,
                          monkeypatch)
    assert json.loads(out)["step_time_s"] != mapped["step_time_s"]
    code, _, err = _cli(["place", "--model", cnn_zoo, "-c", "2xK80", "--map", str(split), "--schedule", "1f1b"],
                        capsys, monkeypatch)
    assert code == 2 and "--microbatches" in err
    code, out, err = _cli(["run", "--model", cnn_zoo, "-c", "2xK80", "--placer", "pipeline", "--schedule", "gpipe",
                           "--microbatches", "2", "--steps", "1", "--warmup", "0", "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["schedule"]["kind"] == "gpipe"


class _HF(nn.Module):
    """A tiny transformers model, zoo-style: input_ids -> its own loss (labels = inputs). "llama": a Llama-style
    decoder (rotary positions, grouped-query attention); "t5": an encoder-decoder with tied embeddings, one
    copy before the cut under two names (the encoder's and the decoder's) and one after it (the LM head)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers as tf

        if kind == "llama":
            self.model = tf.LlamaForCausalLM(tf.LlamaConfig(
                vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32))
        else:
            self.model = tf.T5ForConditionalGeneration(tf.T5Config(
                vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def _tiny(kind: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A tiny model of `kind` ("gpt2", "cnn", "llama", "t5") and its inputs; the transformers ones in eval mode (no
    dropout: the pipelined and the unpipelined step compute the same numbers)."""
    if kind in ("gpt2", "cnn"):
        return _build(kind)
    torch.manual_seed(0)
    return _HF(kind).eval(), (torch.randint(1, 64, (4, 8)),)


def _runs_like_the_unpipelined_step(model: nn.Module, inputs: tuple[torch.Tensor, ...], split: PipelineSplit) -> None:
    """The export of `split`, through JSON text, run for one step: loss and every parameter gradient as the
    unpipelined step's."""
    ran = run_pipeline(model, inputs, json.loads(json.dumps(split.to_dict())), steps=1, optimizer="sgd",
                       return_grads=True)
    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    assert ran.losses[0] == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(ran.grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad()


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_a_placer_placement_exports_at_module_starts_and_runs_like_the_unpipelined_step(kind):
    """Issue 23 item 1: the export of a placer's placement (not a hand split) cuts where a module call of the
    model begins, and the pipelined step's loss and gradients match the model's."""
    model, inputs = _tiny(kind)
    p = plan(model, inputs, "2xK80", placer="even")
    split = pipeline_split(p.graph, p.placement, p.cluster, model, schedule=Schedule("gpipe", 2))
    assert len(split.split_points) == 1 and split.split_points[0] in callable_modules(model)
    _runs_like_the_unpipelined_step(model, inputs, split)


@pytest.mark.parametrize(("kind", "point"), [("llama", "model.model.layers.0.self_attn.v_proj"),
                                             ("llama", "model.model.layers.1.mlp"),
                                             ("t5", "model.encoder.block.1.layer.0.SelfAttention.v"),
                                             ("t5", "model.decoder.block.0.layer.1.EncDecAttention")])
def test_a_cut_inside_a_block_runs_like_the_unpipelined_step(kind, point):
    """torch's pipelining splits at any module call's beginning, inside attention too (the cuts before v_proj
    that failed in issue 23 now run: boundaries are made contiguous), so the placers may cut a captured model at
    every module start (`cuts="modules"`): such a split's loss and gradients match the unpipelined step."""
    model, inputs = _tiny(kind)
    p = plan(model, inputs, "2xK80", placer="single")
    split = pipeline_split(p.graph, placement_from_module_map(p.graph, p.cluster, [point]), p.cluster, model,
                           schedule=Schedule("1f1b", 2))
    assert split.split_points == (point,) and split.moved_fraction == 0.0
    _runs_like_the_unpipelined_step(model, inputs, split)


@pytest.mark.parametrize("kind", ["gpt2", "cnn", "llama", "t5"])
def test_the_pipeline_placer_cuts_where_the_export_cuts_and_its_step_runs(kind):
    """Issue 23 item 1: the `pipeline` placer cuts a captured model only where torch's pipelining can (module
    starts), so its export moves nothing: the exported stages are the placed ones, their simulated pipelined
    step is the placer's own, and the run's loss and gradients match the unpipelined step."""
    model, inputs = _tiny(kind)
    p = plan(model, inputs, "2xK80", placer="pipeline", schedule="1f1b", microbatches=2)
    split = pipeline_split(p.graph, p.placement, p.cluster, model)
    assert len(split.devices) == 2 and set(split.split_points) <= callable_modules(model)
    assert split.moved_fraction == 0.0
    assert split.placement.assignment == p.runtime_placement.assignment
    assert split.pipelined_step_time_s == p.result.step_time_s
    _runs_like_the_unpipelined_step(model, inputs, split)


def test_the_pipeline_placer_on_a_coarsened_capture_cuts_between_groups_at_module_starts():
    """Coarse groups can hold ops of two modules; the placer cuts only between groups whose forward ops lie on
    either side of a module start, so the export still moves nothing."""
    model, inputs = _tiny("gpt2")
    p = plan(model, inputs, "2xK80", placer="pipeline", schedule="gpipe", microbatches=2, max_nodes=80)
    assert p.coarse is not None and p.coarse.num_groups <= 80
    split = pipeline_split(p.graph, p.placement, p.cluster, model)
    assert len(split.devices) == 2 and split.moved_fraction == 0.0
    assert split.placement.assignment == p.runtime_placement.assignment


def test_cuts_anywhere_is_a_setting_whose_export_says_what_it_moved():
    """`cuts="ops"` lets the placer cut between any two ops (between a module's own ops too); the export then
    moves the cut to a module start and says by how much, and its own pipelined step is simulated."""
    model, inputs = _tiny("gpt2")
    p = plan(model, inputs, "2xK80", placer="pipeline", schedule="1f1b", microbatches=2, cuts="ops")
    split = pipeline_split(p.graph, p.placement, p.cluster, model)
    assert split.moved_fraction > 0 and split.pipelined_step_time_s is not None
    # its own step: the moved cut's, simulated (which may equal the placer's cut's: a step the moved ops do not
    # bound, as here since the step counts the gradients' adds and division, 1.2306 ms either way)
    assert split.placement.assignment != p.placement.assignment
    assert split.pipelined_step_time_s == simulate(p.graph, p.cluster, split.placement,
                                                   schedule=split.schedule).step_time_s
    assert "moved" in split.summary() and f"{100 * split.moved_fraction:.1f}%" in split.summary()


@pytest.mark.parametrize(("kind", "points", "schedule"), [  # Llama on 3 stages: tests/test_matrix.py
    ("t5", ["model.encoder.block.1", "model.decoder.block.0", "model.decoder.block.1"], Schedule("gpipe", 2))])
def test_three_and_four_stages_run_a_value_read_by_a_later_stage(kind, points, schedule):
    """Issue 30 item 1: every Llama layer reads the rotary tables stage 0 makes, every T5 decoder block the
    encoder's output, and the last stage the labels: torch's pipelining died on such a split ("Backward of
    skip connections not supported yet"); the runner now passes such a value on through the stages between,
    and the simulator sends it the same way (relay hops on the links between)."""
    model, inputs = _tiny(kind)
    p = plan(model, inputs, "4xV100-16GB", placer="single")
    split = pipeline_split(p.graph, placement_from_module_map(p.graph, p.cluster, points), p.cluster, model,
                           schedule=schedule)
    assert split.split_points == tuple(points) and split.pipelined_step_time_s is not None
    _runs_like_the_unpipelined_step(model, inputs, split)


def test_the_captured_tied_embedding_is_simulated_as_the_runtime_sums_it(planned):
    """The tiny GPT-2's `wte` is tied with its head: run on 3 stages, each of the first and last holds a copy and
    their gradients are summed once per step (`_tied`, above). The simulator does the same on the capture: the
    head's gradient of it (lm_head's weight gradient) goes to stage 0 once, the embedding's back once, both
    at full size (no relay through stage 1, no transfer per micro-batch), and the last stage holds the copy."""
    from devplace.graph.ties import tie_classes
    from devplace.hardware.cluster import load_cluster
    from devplace.sim.schedule import simulate_schedule

    name, _, _, p = planned
    if name != "gpt2":
        pytest.skip("the tied model")
    g = p.graph
    module = [str((x or {}).get("module", "")) for x in g.node_extra]

    def by_module(path: str) -> int:  # stage 1: block 1; 2: ln_f, the head, the loss; 0: the rest (embeddings)
        return 1 if ".h.1" in path else 2 if ".ln_f" in path or ".lm_head" in path or path == "model" else 0

    classes = tie_classes(g)
    home: dict[int, int] = {}
    for v in range(g.num_nodes):
        if g.kind[v] == "forward" and g.op[v] != "input":
            home.setdefault(int(classes[v]), by_module(module[v]))
    devices = np.array([home.get(int(classes[v]), by_module(module[v])) for v in range(g.num_nodes)])
    m = 4
    r = simulate_schedule(g, load_cluster("4xV100-16GB"), devices, Schedule("1f1b", m))
    grad = 64 * 32 * 4  # wte's fp32 gradient
    wte = [(g.ids[int(x)].split("/")[0], int(a), int(b), int(k)) for x, a, b, nb, k in
           zip(r.transfers.node, r.transfers.src_dev, r.transfers.dst_dev, r.transfers.nbytes, r.transfer_microbatch,
               strict=True) if nb == grad and ("lm_head/mm" in g.ids[int(x)] or "wte/" in g.ids[int(x)])]
    assert sorted(wte) == [("model.lm_head", 2, 0, m - 1), ("model.transformer.wte", 0, 2, m - 1)]
    # everything the head's backward sends: that one gradient (its input gradient stays on its stage)
    head = [(int(a), int(b), int(k)) for x, a, b, k in zip(r.transfers.node, r.transfers.src_dev, r.transfers.dst_dev,
                                                           r.transfer_microbatch, strict=True)
            if module[int(x)] == "model.lm_head" and g.kind[int(x)] == "backward"]
    assert head == [(2, 0, m - 1)]
    update = [v for v in range(g.num_nodes) if module[v] == "model.transformer.wte" and g.kind[v] == "optimizer"]
    assert r.copy_bytes.tolist() == [0.0, 0.0, float(g.param_bytes[update].sum()), 0.0]
    assert r.to_dict()["tied_copy_bytes"] == r.copy_bytes.tolist()  # --json shows them too
