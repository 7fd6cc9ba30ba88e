"""Training one placeto policy over several graphs (issue 5 item 3): determinism, resume, checkpoints, zero-shot
use on an unseen graph, the Ray backend and the `devplace train` / `plot-curve` commands."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import devplace
from conftest import cluster
from devplace.cli import app
from devplace.graph import save_graph
from devplace.hardware.cluster import save_cluster
from devplace.placers import place
from devplace.placers.rl import load_policy, save_policy, train
from devplace.placers.rl.checkpoint import FORMAT, PolicyFileError
from devplace.placers.rl.curve import read_curve
from devplace.placers.rl.trainer import parse_indices
from devplace.sim import simulate
from devplace.sim.devplace_model import DevplaceModel
from devplace.zoo import layered_graph

SMALL = {"hidden": 8, "rounds": 2}


def graphs(k: int = 2) -> list:
    return [layered_graph(24, width=4, seed=s) for s in range(k)]


C3 = cluster(3, bw=12e9, lat=1e-5)


def times(result) -> list[float]:
    return [r["step_time_s"] for r in result.rows]


def test_same_seed_same_curve_and_resume_continues_exactly(tmp_path):
    gs = graphs()
    r1 = train(gs, C3, episodes=3, seed=4, **SMALL)
    r2 = devplace.train(gs, C3, episodes=3, seed=4, **SMALL)  # the top-level re-export
    assert times(r1) == times(r2) and [r["entropy"] for r in r1.rows] == [r["entropy"] for r in r2.rows]
    assert [(r["episode"], r["graph"]) for r in r1.rows] == [(e, g.name) for e in range(3) for g in gs]
    assert times(train(gs, C3, episodes=3, seed=5, **SMALL)) != times(r1)
    # two rounds, saved, then one more from the checkpoint: the same curve as three in one go
    train(gs, C3, episodes=2, seed=4, output=tmp_path / "p.pt", **SMALL)
    r3 = train(gs, C3, episodes=1, seed=4, resume=tmp_path / "p.pt")
    assert times(r3) == times(r1)[4:] and r3.episodes_done == 3
    for g in gs:  # each graph's best is a feasible placement with that step time, never worse than its start
        devices, t = r1.best[g.name]
        assert DevplaceModel(g, C3).run(devices).feasible
        assert DevplaceModel(g, C3).run(devices).step_time_s == pytest.approx(t)
        assert t <= r1.start_step_time_s[g.name]


def test_checkpoint_round_trip_and_bad_files(tmp_path):
    r = train(graphs(1), C3, episodes=1, seed=0, encoder="gat", **SMALL)
    path = save_policy(tmp_path / "p.pt", r.policy)
    doc = torch.load(path, weights_only=True)  # tensors and plain settings only
    assert doc["format"] == FORMAT and doc["encoder"] == "gat" and doc["num_devices"] == 3
    policy, _ = load_policy(path, num_devices=3)
    assert policy.encoder == "gat" and policy.hidden == 8 and policy.rounds == 2
    for a, b in zip(policy.state_dict().values(), r.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(PolicyFileError, match="trained for 3 devices, the cluster has 2"):
        load_policy(path, num_devices=2)
    with pytest.raises(PolicyFileError, match="no training state to resume"):
        train(graphs(1), C3, episodes=1, resume=path)
    doc["format"] = "devplace.policy/99"
    torch.save(doc, tmp_path / "future.pt")
    with pytest.raises(PolicyFileError, match=r"unknown policy format 'devplace\.policy/99'"):
        load_policy(tmp_path / "future.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(PolicyFileError, match="not a devplace policy checkpoint"):
        load_policy(tmp_path / "junk.pt")
    with pytest.raises(PolicyFileError, match="no policy file"):
        load_policy(tmp_path / "missing.pt")


def test_checkpoints_name_the_encoder_placeto_gnn_and_old_ones_still_load(tmp_path):
    r = train(graphs(1), C3, episodes=1, seed=0, **SMALL)
    path = save_policy(tmp_path / "p.pt", r.policy)
    doc = torch.load(path, weights_only=True)
    assert doc["encoder"] == "placeto-gnn"
    doc["encoder"] = "placeto"  # what checkpoints said before the encoder was named placeto-gnn
    torch.save(doc, tmp_path / "old.pt")
    policy, _ = load_policy(tmp_path / "old.pt")
    assert policy.encoder == "placeto-gnn"
    for a, b in zip(policy.state_dict().values(), r.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    doc["encoder"] = "gnn"
    torch.save(doc, tmp_path / "bad.pt")
    with pytest.raises(PolicyFileError, match="missing or bad: encoder"):
        load_policy(tmp_path / "bad.pt")


def test_trained_policy_applies_to_an_unseen_graph(tmp_path):
    train(graphs(2), C3, episodes=2, seed=1, output=tmp_path / "p.pt", **SMALL)
    unseen = layered_graph(33, width=5, seed=99)
    zero_shot = place(unseen, C3, placer="placeto", seed=0, episodes=0, policy=str(tmp_path / "p.pt"),
                      log=str(tmp_path / "z.csv"))
    assert simulate(unseen, C3, zero_shot).feasible
    assert [r["greedy"] for r in read_curve(tmp_path / "z.csv")] == [1]  # zero-shot: the argmax episode only
    tuned = place(unseen, C3, placer="placeto", seed=0, episodes=2, policy=str(tmp_path / "p.pt"))
    assert simulate(unseen, C3, tuned).step_time_s <= simulate(unseen, C3, zero_shot).step_time_s
    with pytest.raises(PolicyFileError, match="trained for 3 devices"):
        place(unseen, cluster(2), placer="placeto", policy=str(tmp_path / "p.pt"))


def test_ray_backend_trains_a_valid_policy_with_the_local_curve(tmp_path):
    ray = pytest.importorskip("ray")
    gs = graphs(2)
    local = train(gs, C3, episodes=1, seed=2, **SMALL)
    running = ray.is_initialized()  # another test may have left Ray running: then train must leave it so
    remote = train(gs, C3, episodes=1, seed=2, backend="ray", workers=1, output=tmp_path / "p.pt", **SMALL)
    assert ray.is_initialized() == running  # when devplace started Ray, it stopped it
    assert times(remote) == times(local)
    policy, _ = load_policy(tmp_path / "p.pt", num_devices=3)
    for a, b in zip(policy.state_dict().values(), local.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_parse_indices():
    assert parse_indices("0-3,7", 32) == [0, 1, 2, 3, 7]
    assert parse_indices("5", 32) == [5]
    for bad in ("0-32", "a-b", "3-1"):
        with pytest.raises(Exception, match="--graphs"):
            parse_indices(bad, 32)


def test_cli_train_then_place_and_plot(tmp_path):
    runner = CliRunner()
    paths = []
    for i, g in enumerate(graphs(2)):
        paths.append(str(tmp_path / f"g{i}.json"))
        save_graph(g, paths[-1])
    save_cluster(C3, tmp_path / "c.json")
    out = runner.invoke(app, ["train", *paths, "-c", str(tmp_path / "c.json"), "--episodes", "2", "--hidden", "8",
                              "--rounds", "2", "--encoder", "sage", "-o", str(tmp_path / "p.pt"), "--log",
                              str(tmp_path / "run.csv"), "-q"])
    assert out.exit_code == 0, out.output
    assert "trained placeto" in out.output and (tmp_path / "p.pt").is_file()
    assert len(read_curve(tmp_path / "run.csv")) == 4
    out = runner.invoke(app, ["plot-curve", str(tmp_path / "run.csv"), "-o", str(tmp_path / "c.png")])
    assert out.exit_code == 0 and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    out = runner.invoke(app, ["place", paths[0], "-c", str(tmp_path / "c.json"), "--placer", "placeto", "--set",
                              f"policy={tmp_path / 'p.pt'}", "--set", "episodes=0", "--json"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["train", paths[0], "-c", str(tmp_path / "c.json"), "--placer", "seq2seq"])
    assert out.exit_code != 0 and "placeto only" in str(out.exception) + out.output
    assert np.isfinite(read_curve(tmp_path / "run.csv")[0]["entropy"])
