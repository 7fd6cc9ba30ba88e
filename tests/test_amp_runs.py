"""Plans captured under autocast (--amp) run pipelined and as parallel plans (issue 30/31: a plan devplace gives
runs): the stages are traced and run under the CPU's autocast and the first loss equals the one-process step's;
a model whose loss is its outputs' sum is summed over the micro-batches, not averaged."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli as run
from test_parallel_search import TOWER


@pytest.fixture
def tower(python_package) -> str:
    return python_package("amp_pkg", TOWER) + ":build"


def _run(args: list[str], capsys, monkeypatch) -> dict:
    code, out, err = run(args, capsys, monkeypatch)
    assert code == 0, err
    return json.loads(out)


def test_a_pipelined_amp_plan_runs_as_captured_and_sums_a_summed_loss(tower, capsys, monkeypatch):
    for amp in ([], ["--amp"]):  # fp32 too: the tower's loss is its outputs' sum, over 2 micro-batches
        ran = _run(["run", "--model", tower, "--batch", "64", "-c", "2xK80", *amp, "--placer", "pipeline",
                    "--schedule", "1f1b", "--microbatches", "2", "--steps", "1", "--warmup", "0", "--json"],
                   capsys, monkeypatch)
        assert ran["processes"] == 2
        assert ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)


def test_a_parallel_amp_plan_runs_as_captured(tower, tmp_path, capsys, monkeypatch):
    plan = tmp_path / "plan.json"
    _run(["place", "--model", tower, "--batch", "64", "-c", "2xK80", "--amp", "--dp", "2", "--zero", "1",
          "--recompute", "full", "--save-plan", str(plan), "--json"], capsys, monkeypatch)
    ran = _run(["run", "--plan", str(plan), "--trust-model", "--steps", "1", "--warmup", "0", "--json"], capsys,
               monkeypatch)
    assert ran["processes"] == 2 and ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)


@pytest.mark.parametrize(("fmt", "flags", "precision"), [("pipeline", ["--amp"], {"autocast": "bfloat16"}),
                                                      ("parallel", ["--amp"], {"autocast": "bfloat16"}),
                                                      ("pipeline", ["--dtype", "bf16"], {"dtype": "bf16"})])
def test_the_export_of_an_amp_plan_records_autocast_and_runs_under_it(fmt, flags, precision, tower, tmp_path, capsys,
                                                                       monkeypatch):
    """`devplace export` of an --amp plan writes the autocast dtype into the pipeline / parallel export, and `run
    --pipeline` / `run --parallel` of it runs under autocast: its loss is the one-process autocast step's, which
    differs from the fp32 one (the same export without its precision runs in fp32). A --dtype plan's export
    records its dtype, and runs cast to it, likewise."""
    plan, ex = tmp_path / "plan.json", tmp_path / f"{fmt}.json"
    _run(["place", "--model", tower, "--batch", "64", "-c", "2xK80", *flags, "--placer", "pipeline", "--schedule",
          "1f1b", "--microbatches", "2", "--save-plan", str(plan), "--json"], capsys, monkeypatch)
    code, _, err = run(["export", str(plan), "--format", fmt, "-o", str(ex)], capsys, monkeypatch)
    assert code == 0, err
    doc = json.loads(ex.read_text())
    assert doc["precision"] == precision
    fp32 = tmp_path / f"{fmt}-fp32.json"
    fp32.write_text(json.dumps({k: v for k, v in doc.items() if k != "precision"}))
    losses = {}
    for name, path in (("amp", ex), ("fp32", fp32)):
        ran = _run(["run", f"--{fmt}", str(path), "--trust-model", "--steps", "1", "--warmup", "0", "--json"],
                   capsys, monkeypatch)
        assert ran["losses"][0] == pytest.approx(ran["reference_loss"], rel=1e-5)
        losses[name] = ran["reference_loss"]
    assert losses["amp"] != pytest.approx(losses["fp32"], rel=1e-5)


def test_a_malformed_export_precision_is_a_clear_error(tower, tmp_path, capsys, monkeypatch):
    plan, ex = tmp_path / "plan.json", tmp_path / "pipeline.json"
    _run(["place", "--model", tower, "--batch", "64", "-c", "2xK80", "--amp", "--placer", "pipeline", "--schedule",
          "1f1b", "--microbatches", "2", "--save-plan", str(plan), "--json"], capsys, monkeypatch)
    assert run(["export", str(plan), "--format", "pipeline", "-o", str(ex)], capsys, monkeypatch)[0] == 0
    ex.write_text(json.dumps({**json.loads(ex.read_text()), "precision": {"autocast": "float64"}}))
    code, _, err = run(["run", "--pipeline", str(ex), "--trust-model", "--steps", "1"], capsys, monkeypatch)
    assert code == 2 and "precision must be an object" in err and "re-export" in err
