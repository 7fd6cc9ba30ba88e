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
