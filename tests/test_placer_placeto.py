"""`placeto`: the Placeto-style RL placer (issue 5 item 1)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cluster, graph
from devplace.orders import traversal_indices, traversal_order
from devplace.placers import PlacerError, get_placer, place
from devplace.placers.rl.curve import read_curve
from devplace.placers.rl.placeto import (
    HYPER_SETS,
    PlacetoHyper,
    PlacetoPolicy,
    _GraphContext,
    _sum_neighbours,
    num_parameters,
    resolve_hyper,
    train_placeto,
)
from devplace.sim import simulate
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.placeto import PlacetoModel
from devplace.zoo import layered_graph

FAST = PlacetoHyper(episodes=3, rounds=2, hidden=8)


def two_chains(params: float = 0.0):
    """A cheap source feeding two independent chains of 4 heavy ops each, joined by a cheap sink."""
    nodes = [{"id": "src", "compute_s": 0.01}, {"id": "sink", "compute_s": 0.01}]
    edges = []
    for c in "ab":
        nodes += [{"id": f"{c}{i}", "compute_s": 1.0, "param_bytes": params} for i in range(4)]
        edges += [("src", f"{c}0", 1.0), (f"{c}3", "sink", 1.0)]
        edges += [(f"{c}{i}", f"{c}{i + 1}", 1.0) for i in range(3)]
    return graph(nodes, edges, name="two-chains")


def test_registered_as_a_sequential_placer_with_its_settings():
    spec = get_placer("placeto")
    assert spec.uses_order and spec.reports_progress
    # None: the value of the named set `hyper`
    assert spec.settings == {"episodes": 50, "memory_penalty": None, "rounds": None, "hidden": None,
                             "encoder": "placeto-gnn", "sim_model": "devplace", "lr": None, "start": None,
                             "parallel": 1, "update_fraction": 1.0, "hyper": "devplace", "policy": None, "log": None}
    # the defaults are PlacetoHyper's, the one place they are written; every named set agrees with the settings
    # that have a value of their own (so naming a set never overrides it with a default)
    assert HYPER_SETS["devplace"] == PlacetoHyper()
    for hyper in HYPER_SETS.values():
        assert all(getattr(hyper, k) == v for k, v in spec.settings.items()
                   if k not in ("policy", "log", "hyper") and v is not None)


def test_placeto_paper_set_is_the_seed_studys_and_settings_replace_its_values():
    paper = HYPER_SETS["placeto-paper"]
    assert (paper.episodes, paper.eval_every, paper.start, paper.discount, paper.entropy_weight) == \
        (50, 5, "device0", 1.0, 1.0)
    assert (paper.normalize_advantage, paper.loss_sum, paper.memory_penalty, paper.hidden, paper.rounds) == \
        (False, True, 0.0, 8, 8)
    assert (paper.lr, paper.grad_clip, paper.baseline_window) == (1e-3, 1.25, 1000)
    assert resolve_hyper("placeto-paper", hidden=16, start=None) == replace(paper, hidden=16)
    g = layered_graph(10, width=3, seed=1)
    with pytest.raises(PlacerError, match="unknown hyperparameter set 'paper'; choose one of: devplace, "
                                          "placeto-paper"):
        place(g, cluster(2), placer="placeto", hyper="paper")
    spec = get_placer("placeto")
    with pytest.raises(PlacerError, match="unknown hyperparameter set"):
        spec.check_settings({"hyper": ["placeto-paper"]})  # as a study file would give it, refused when read
    from devplace.study import load_study

    seed_preset = load_study("seed", preset=True)
    assert [p.settings for p in seed_preset.placers if p.name == "placeto"] == [
        {"episodes": 50, "hyper": "placeto-paper"}]


def test_placeto_paper_evaluates_every_5th_episode_greedily_without_touching_the_best():
    g = two_chains()
    c = cluster(2, bw=1e3, speeds=[1.0, 2.0])  # device 1 is twice as fast: moving any heavy op there helps
    o = traversal_indices(g, "topo")
    policy = PlacetoPolicy(_GraphContext(g, c, FAST).num_features, 2, hidden=8, rounds=2)
    with torch.no_grad():
        policy.head[-1].bias.copy_(torch.tensor([0.0, 50.0]))  # argmax: device 1 for every node
    # devplace's final argmax episode may improve the best so far; Placeto's evaluation (episode 0) may not (the
    # answer is then still judged against every single device: all on the fast one here, for both)
    devplace = train_placeto(g, c, o, 0, PlacetoHyper(episodes=0, hidden=8, rounds=2, start="device0"),
                             policy=policy)
    assert devplace.rows[0]["best_step_time_s"] < 0.6 * devplace.start_step_time_s
    paper = train_placeto(g, c, o, 0, resolve_hyper("placeto-paper", episodes=1, hidden=8, rounds=2),
                          policy=policy)
    assert paper.rows[0]["best_step_time_s"] == paper.start_step_time_s and paper.rows[0]["greedy"] == 1
    assert paper.eval_step_time_s < 0.6 * paper.start_step_time_s  # the evaluation did find the better states
    run = train_placeto(g, c, o, 1, resolve_hyper("placeto-paper", episodes=11, hidden=8, rounds=2))
    assert [r["greedy"] for r in run.rows] == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]  # 11 episodes in all, no extra
    assert len(run.curve) == 8 and len(run.visits) == 11
    before = run.start_step_time_s
    for r in run.rows:
        if r["greedy"]:
            assert r["best_step_time_s"] == before
        before = r["best_step_time_s"]


def test_old_names_of_the_encoder_and_the_simulation_model_are_aliases():
    """`placeto-gnn` and `placeto-sim` are the names; the old `placeto` of each is read as them."""
    hyper = PlacetoHyper(encoder="placeto", sim_model="placeto")
    assert (hyper.encoder, hyper.sim_model) == ("placeto-gnn", "placeto-sim")
    assert replace(FAST, encoder="placeto").encoder == "placeto-gnn"
    assert PlacetoPolicy(5, 2, hidden=4, rounds=1, encoder="placeto").encoder == "placeto-gnn"
    g = layered_graph(12, width=3, seed=0)
    with pytest.raises(PlacerError, match=r"unknown encoder 'gnn'.*placeto-gnn, sage, gat \(placeto: same as"):
        place(g, cluster(2), placer="placeto", order="topo", encoder="gnn", episodes=0)
    with pytest.raises(PlacerError, match=r"unknown sim_model 'sim'.*devplace, placeto-sim \(placeto: same as"):
        place(g, cluster(2), placer="placeto", order="topo", sim_model="sim", episodes=0)


@pytest.mark.parametrize("encoder", ["placeto-gnn", "sage", "gat"])
def test_parameter_count_does_not_depend_on_the_graph(encoder):
    c = cluster(3, bw=12e9, mem=1e12)
    small, big = layered_graph(20, width=4, seed=1), layered_graph(150, width=10, seed=2)
    hyper = PlacetoHyper(episodes=0, encoder=encoder)
    counts = [train_placeto(g, c, traversal_indices(g, "topo"), 0, hyper).num_parameters for g in (small, big)]
    assert counts[0] == counts[1] > 0
    nf = _GraphContext(small, c, hyper).num_features
    assert num_parameters(PlacetoPolicy(nf, 3, encoder=encoder)) == counts[0]


@pytest.mark.parametrize("order", ["topo", "dfs-preorder", "lexicographic"])
def test_every_episode_visits_every_node_once_in_the_traversal_order(order):
    g = layered_graph(40, width=5, seed=4)
    run = train_placeto(g, cluster(2, bw=12e9), traversal_indices(g, order), 0, FAST)
    assert len(run.visits) == FAST.episodes + 1  # training episodes + the argmax episode
    for visited in run.visits:
        assert [g.ids[v] for v in visited] == traversal_order(g, order)


def test_same_seed_same_placement_and_learning_curve():
    g = layered_graph(60, width=6, seed=5)
    c = cluster(3, bw=12e9, lat=1e-5)
    o = traversal_indices(g, "topo")
    hyper = PlacetoHyper(episodes=4, rounds=3, hidden=16)
    r1, r2 = (train_placeto(g, c, o, 11, hyper) for _ in range(2))
    assert np.array_equal(r1.devices, r2.devices)
    assert r1.curve == r2.curve and r1.best_curve == r2.best_curve and len(r1.curve) == 4
    r3 = train_placeto(g, c, o, 12, hyper)
    assert r3.curve != r1.curve  # the seed drives the sampling
    # the result is the best feasible placement seen, never worse than the start, and the curve says so
    assert r1.step_time_s == r1.best_curve[-1] <= r1.start_step_time_s
    assert DevplaceModel(g, c).run(r1.devices).step_time_s == pytest.approx(r1.step_time_s)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reaches_the_optimum_on_two_independent_heavy_chains(seed):
    g = two_chains()
    c = cluster(2, bw=1e3, lat=0.0)  # 1-byte tensors: 1 ms per transfer
    run = train_placeto(g, c, traversal_indices(g, "topo"), seed, PlacetoHyper(episodes=30, start="device0"))
    assert run.start_step_time_s == pytest.approx(8.02)  # all on device 0
    # optimum: the heavy ops split 4 + 4 so the chains run side by side: one chain (4 s) + src and sink
    # (2 x 10 ms) + a few 1 ms transfers (a chain may also hop devices in step with the other one)
    assert run.step_time_s <= 4.02 + 0.004
    heavy = [run.devices[g.index[f"{c}{i}"]] for c in "ab" for i in range(4)]
    assert sorted(np.bincount(heavy, minlength=2).tolist()) == [4, 4]


def test_memory_penalty_keeps_a_tight_cluster_feasible():
    # every chain op holds 100 bytes of parameters; a device holds 450: one chain per device is the only fit
    g = two_chains(params=100.0)
    c = cluster(2, bw=1e3, mem=450.0)
    assert not DevplaceModel(g, c).run(np.zeros(g.num_nodes, dtype=np.int64)).feasible
    for penalty in (0.0, 1.0, 10.0):
        p = place(g, c, placer="placeto", order="topo", seed=3, episodes=5, memory_penalty=penalty, rounds=2,
                  hidden=8)
        assert simulate(g, c, p).feasible
    run = train_placeto(g, c, traversal_indices(g, "topo"), 3, PlacetoHyper(episodes=5, memory_penalty=10.0))
    assert DevplaceModel(g, c).run(run.devices).feasible


def test_place_reports_progress_per_episode():
    g = layered_graph(30, width=4, seed=6)
    calls: list[tuple[int, int]] = []
    place(g, cluster(2, bw=12e9), placer="placeto", episodes=2, rounds=2, hidden=8,
          progress=lambda d, t: calls.append((d, t)))
    assert calls == [(0, 3), (1, 3), (2, 3)]


def test_bad_settings_say_so():
    g = layered_graph(10, width=3, seed=1)
    with pytest.raises(PlacerError, match="unknown sim_model 'tf'"):
        place(g, cluster(2), placer="placeto", sim_model="tf")
    with pytest.raises(PlacerError, match="unknown encoder 'gcn'"):
        place(g, cluster(2), placer="placeto", encoder="gcn")
    with pytest.raises(PlacerError, match="episodes must be an integer"):
        place(g, cluster(2), placer="placeto", episodes=-1)


def test_pooling_sets_ancestors_descendants_parallel():
    g = graph([("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 1.0), ("e", 1.0)],
              [("a", "b", 1.0), ("b", "d", 1.0), ("a", "c", 1.0), ("c", "d", 1.0)])
    ctx = _GraphContext(g, cluster(2), PlacetoHyper())
    masks = ctx.pools(g.index["b"], np.zeros(g.num_nodes))
    names = [{g.ids[v] for v in np.flatnonzero(m)} for m in masks]
    assert names == [{"a"}, {"d"}, {"c", "e"}]
    # big-graph mode: each set cut to the nearest in start time
    ctx.hyper = PlacetoHyper(pool_exact_max_nodes=2, pool_nearest=1)
    start = np.array([0.0, 1.0, 5.0, 3.0, 1.5])
    masks = ctx.pools(g.index["b"], start)
    assert [{g.ids[v] for v in np.flatnonzero(m)} for m in masks] == [{"a"}, {"d"}, {"e"}]


@pytest.mark.parametrize("encoder", ["sage", "gat"])
def test_sage_and_gat_encoders_learn_the_two_chains(encoder):
    g = two_chains()
    c = cluster(2, bw=1e3, lat=0.0)
    o = traversal_indices(g, "topo")
    run = train_placeto(g, c, o, 0, PlacetoHyper(episodes=20, encoder=encoder, rounds=3, hidden=16,
                                                 start="device0"))
    assert run.step_time_s <= 4.02 + 0.004
    assert [g.ids[v] for v in run.visits[0]] == traversal_order(g, "topo")
    # the encoders really differ: the same seed gives different first-episode logits, so different curves
    other = train_placeto(g, c, o, 0, PlacetoHyper(episodes=3, encoder="placeto", rounds=3, hidden=16))
    mine = train_placeto(g, c, o, 0, PlacetoHyper(episodes=3, encoder=encoder, rounds=3, hidden=16))
    assert [r["entropy"] for r in other.rows] != [r["entropy"] for r in mine.rows]


def test_the_three_pools_sum_each_its_own_members():
    g = layered_graph(25, width=4, seed=3)
    ctx = _GraphContext(g, cluster(3), PlacetoHyper(rounds=2, hidden=8))
    policy = PlacetoPolicy(ctx.num_features, 3, 8, 2)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(4, g.num_nodes, ctx.num_features, generator=gen)
    masks = (torch.rand(4, 3, g.num_nodes, generator=gen) > 0.5).float()
    current = torch.tensor([0, 5, 9, 24])
    emb = policy.embed(x, ctx.adj)  # [V, batch, 2d]
    summaries = []
    for s in range(3):  # pool s: relu(g_s(sum over its members of relu(f_s(embedding))))
        z = torch.relu(policy.pool_f[s](emb))  # [V, batch, d]
        summaries.append(torch.relu(policy.pool_g[s]((masks[:, s].T[..., None] * z).sum(0))))
    reference = policy.head(torch.cat([emb[current, torch.arange(4)], *summaries], dim=-1))
    assert torch.allclose(policy(x, ctx.adj, current, masks), reference, atol=1e-5)


def test_encoders_embed_a_batch_of_states_like_one_state_at_a_time():
    g = layered_graph(25, width=4, seed=3)
    c = cluster(3)
    for encoder in ("placeto", "sage", "gat"):
        hyper = PlacetoHyper(encoder=encoder, rounds=2, hidden=8)
        ctx = _GraphContext(g, c, hyper)
        policy = PlacetoPolicy(ctx.num_features, 3, 8, 2, encoder)
        x = torch.rand(4, g.num_nodes, ctx.num_features, generator=torch.Generator().manual_seed(0))
        batched = policy.embed(x, ctx.adj)
        single = torch.cat([policy.embed(x[b:b + 1], ctx.adj) for b in range(4)], dim=1)
        assert torch.allclose(batched, single, atol=1e-5)
        assert batched.shape == (g.num_nodes, 4, 16)
        masks = torch.ones(4, 3, g.num_nodes)
        with torch.inference_mode():  # the rollout's in-place path computes the same embedding and logits
            assert torch.allclose(policy.embed(x, ctx.adj), batched, atol=1e-5)
            fast = policy(x, ctx.adj, torch.arange(4), masks)
        assert torch.allclose(fast, policy(x, ctx.adj, torch.arange(4), masks), atol=1e-5)


def test_placeto_sim_model_optimises_the_placeto_simulator():
    g = layered_graph(40, width=5, seed=7)
    c = cluster(3, bw=7.6e9, mem=1e12)
    o = traversal_indices(g, "topo")
    hyper = PlacetoHyper(episodes=3, rounds=2, hidden=8, sim_model="placeto", start="device0")
    run = train_placeto(g, c, o, 0, hyper)
    pm = PlacetoModel(g, c)
    # step times in the curve are the placeto model's, and the answer is its best
    assert run.start_step_time_s == pm.run(np.zeros(g.num_nodes, dtype=np.int64)).step_time_s
    assert pm.run(run.devices).step_time_s == pytest.approx(run.step_time_s)
    assert run.step_time_s <= run.start_step_time_s
    assert run.curve != train_placeto(g, c, o, 0, replace(hyper, sim_model="devplace")).curve
    p = place(g, c, placer="placeto", seed=0, episodes=2, rounds=2, hidden=8, sim_model="placeto")
    assert simulate(g, c, p).feasible and p.made_by.settings["sim_model"] == "placeto"


def test_placeto_sim_model_answer_still_fits_the_devplace_memory_model():
    # the placeto model counts no parameters: all on one device "fits" there, but not under devplace
    g = two_chains(params=100.0)
    c = cluster(2, bw=1e3, mem=450.0)
    run = train_placeto(g, c, traversal_indices(g, "topo"), 1, PlacetoHyper(episodes=4, sim_model="placeto",
                                                                          memory_penalty=0.0))
    assert DevplaceModel(g, c).run(run.devices).feasible


def test_log_setting_writes_the_learning_curve(tmp_path):
    g = layered_graph(20, width=4, seed=2)
    path = tmp_path / "run.csv"
    place(g, cluster(2, bw=12e9), placer="placeto", episodes=2, rounds=2, hidden=8, log=str(path))
    rows = read_curve(path)
    assert [r["episode"] for r in rows] == [0, 1, 2] and [r["greedy"] for r in rows] == [0, 0, 1]
    assert all(r["graph"] == g.name for r in rows)
    assert all(r["best_step_time_s"] <= r["step_time_s"] + 1e-15 for r in rows if not r["greedy"])
    assert rows[0]["entropy"] > 0 and rows[-1]["wall_s"] >= rows[0]["wall_s"]


def test_discounted_returns_and_normalised_advantages():
    from collections import deque

    from devplace.placers.rl.placeto import EpisodeLog, advantages_of, returns_of

    log = EpisodeLog([0, 1, 2], [0, 0, 0], [1.0, 2.0, 4.0], 0.0)
    assert returns_of(log).tolist() == [7.0, 6.0, 4.0]  # discount 1: the sum of this and later rewards
    assert returns_of(log, 0.5).tolist() == [1.0 + 1.0 + 1.0, 2.0 + 2.0, 4.0]
    assert returns_of(log, 0.0).tolist() == [1.0, 2.0, 4.0]
    recent: deque[np.ndarray] = deque([np.array([3.0, 2.0, 0.0])], maxlen=10)
    raw = advantages_of(np.array([5.0, 6.0, 4.0]), recent, PlacetoHyper(normalize_advantage=False))
    assert raw.tolist() == [1.0, 2.0, 2.0] and len(recent) == 2  # baseline: mean over recent, this one included
    norm = advantages_of(np.array([5.0, 6.0, 4.0]), deque([np.array([3.0, 2.0, 0.0])]), PlacetoHyper())
    assert norm.std() == pytest.approx(1.0) and np.allclose(norm * raw.std(), raw)  # same signs, unit scale


def test_the_policy_learns_entropy_falls_and_episodes_improve():
    # the defect this guards against: with discount 1 and raw log-ratio advantages the policy stayed uniform
    # (entropy ~ ln 3) and every episode ended as a random placement, several times worse than its start
    # (slow links: a random placement is ~6x worse than all on one device, so a uniform policy shows)
    g = layered_graph(40, width=5, seed=7)
    c = cluster(3, bw=1e9, lat=1e-5)
    run = train_placeto(g, c, traversal_indices(g, "topo"), 0, PlacetoHyper(episodes=25, start="device0"))
    entropy = [r["entropy"] for r in run.rows[:-1]]
    assert entropy[0] > 0.9 * math.log(3) and np.mean(entropy[-5:]) < 0.5 * entropy[0]  # measured 1.09 -> 0.08
    assert np.mean(run.curve[-5:]) < 0.5 * np.mean(run.curve[:5])  # measured 6.1x -> 1.8x the start


def per_step_gradient(policy, ctx, log, advantage, hyper) -> list[torch.Tensor]:
    """The reference: the REINFORCE loss of each step computed from that step's state alone (one forward per
    step, as the rollout acts), summed, then one backward."""
    policy.zero_grad()
    steps = len(log.actions)
    total = torch.zeros(())
    for t in range(steps):
        logits = policy(torch.from_numpy(log.states[t:t + 1]), ctx.adj, torch.tensor([log.visited[t]]),
                        torch.from_numpy(log.pool_masks[t:t + 1].astype(np.float32)))[0]
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum()
        scale = 1.0 if hyper.loss_sum else 1.0 / steps
        total = total - (float(advantage[t]) * logp[log.actions[t]] + hyper.entropy_weight * entropy) * scale
    total.backward()
    return [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize(("encoder", "loss_sum"), [("placeto", False), ("placeto", True), ("sage", False),
                                                   ("gat", False)])
@pytest.mark.parametrize("chunk_floats", [1, 3000, 10**9])  # one state per slice, a few, all in one slice
def test_batched_gradient_equals_the_per_step_computation(encoder, loss_sum, chunk_floats):
    from collections import deque

    from devplace.placers.rl.placeto import (
        accumulate_gradient,
        advantages_of,
        new_best,
        new_policy,
        returns_of,
        run_episode,
        start_placement,
    )

    g = layered_graph(30, width=4, seed=8)
    c = cluster(3, bw=1e9, lat=1e-5)
    hyper = PlacetoHyper(rounds=3, hidden=8, encoder=encoder, update_chunk_floats=chunk_floats, start="device0",
                         loss_sum=loss_sum)
    ctx = _GraphContext(g, c, hyper)
    policy = new_policy(ctx.num_features, 3, hyper, 0)
    o = traversal_indices(g, "topo")
    start, result = start_placement(ctx, o, 0)
    log = run_episode(policy, ctx, start, result, o, new_best(ctx, start, result.step_time_s),
                      torch.Generator().manual_seed(1), memory_penalty=1.0, keep_states=True)
    assert len(set(log.actions)) > 1  # a sampled episode, not a constant one
    adv = advantages_of(returns_of(log, hyper.discount), deque(maxlen=10), hyper)
    reference = per_step_gradient(policy, ctx, log, adv, hyper)
    policy.zero_grad()
    accumulate_gradient(policy, ctx, log, adv, hyper)
    for p, ref in zip(policy.parameters(), reference, strict=True):
        assert torch.allclose(p.grad, ref, rtol=1e-4, atol=1e-6)
    assert any(float(r.abs().max()) > 0 for r in reference)
    # the rollout acted on the same distributions: its entropies are those of the stored states
    with torch.no_grad():
        logits = policy(torch.from_numpy(log.states), ctx.adj, torch.as_tensor(log.visited),
                        torch.from_numpy(log.pool_masks.astype(np.float32)))
    logp = torch.log_softmax(logits, dim=-1)
    assert np.allclose(-(logp.exp() * logp).sum(-1).numpy(), log.entropies, atol=1e-5)


def test_classic_start_is_the_best_classic_placement_and_the_answer_is_no_worse():
    from devplace.placers.rl.start import START_PLACERS

    g = layered_graph(40, width=5, seed=7)
    c = cluster(3, bw=12e9, lat=1e-5)  # fast links: m-etf's spread is about half the step of one device
    model = DevplaceModel(g, c)
    classic = min(model.run(place(g, c, placer=name, order="topo", seed=0).to_array(g, 3)).step_time_s
                  for name in START_PLACERS)
    o = traversal_indices(g, "topo")
    run = train_placeto(g, c, o, 0, PlacetoHyper(episodes=2, rounds=2, hidden=8))
    assert run.start_step_time_s == pytest.approx(classic)
    assert run.step_time_s <= classic
    device0 = train_placeto(g, c, o, 0, PlacetoHyper(episodes=0, rounds=2, hidden=8, start="device0"))
    assert device0.start_step_time_s == pytest.approx(model.run(np.zeros(g.num_nodes, dtype=np.int64)).step_time_s)
    assert device0.start_step_time_s > 1.5 * classic
    with pytest.raises(PlacerError, match="unknown start 'best'; choose one of: classic, device0"):
        place(g, c, placer="placeto", start="best")


def test_parallel_episodes_and_a_partial_update_are_deterministic_and_keep_the_contract():
    # issue 22 item 4: episodes sampled side by side, each update re-embedding part of its states
    g = layered_graph(30, width=4, seed=3)
    c = cluster(3, bw=1e9, lat=1e-5)
    hyper = PlacetoHyper(episodes=5, parallel=3, update_fraction=0.5, hidden=8, rounds=2, start="device0")
    runs = [train_placeto(g, c, traversal_indices(g, "topo"), 4, hyper) for _ in range(2)]
    assert runs[0].curve == runs[1].curve and runs[0].devices.tolist() == runs[1].devices.tolist()
    assert len(runs[0].curve) == 5 and [r["episode"] for r in runs[0].rows] == list(range(6))
    assert runs[0].step_time_s <= runs[0].start_step_time_s


def test_update_steps_draws_a_sorted_fraction_or_takes_all():
    from devplace.placers.rl.placeto import update_steps

    rng = np.random.Generator(np.random.PCG64(0))
    assert update_steps(300, PlacetoHyper(), rng) is None
    steps = update_steps(300, PlacetoHyper(update_fraction=0.25), rng)
    assert len(steps) == 75 and len(set(steps.tolist())) == 75 and steps.tolist() == sorted(steps.tolist())
    for bad in ({"parallel": 0}, {"update_fraction": 0.0}, {"update_fraction": 1.5}):
        with pytest.raises(PlacerError, match=next(iter(bad))):
            place(layered_graph(10, seed=0), cluster(2), placer="placeto", episodes=1, **bad)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 14), edges=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 13)), max_size=40),
       hidden=st.sampled_from([4, 8]), rounds=st.integers(0, 3), batch=st.integers(1, 3), seed=st.integers(0, 99))
def test_compiled_rollout_forward_computes_the_policys_logits(n, edges, hidden, rounds, batch, seed):
    """The rollout's numba forward (placers/rl/rollout.py) against `PlacetoPolicy.forward` on random DAGs
    (isolated nodes, parallel edges, nodes with many parents included): the same logits up to float32 rounding."""
    from devplace.placers.rl.rollout import rollout_logits, rollout_weights

    pairs = [(min(a, b), max(a, b)) for a, b in edges if a != b and max(a, b) < n]
    # a repeated pair is a parallel edge: another tensor of the same producer
    g = graph([(f"v{i}", 1.0 + i % 3) for i in range(n)],
              [(f"v{a}", f"v{b}", 1.0, pairs[:k].count((a, b))) for k, (a, b) in enumerate(pairs)])
    ctx = _GraphContext(g, cluster(3), PlacetoHyper(rounds=rounds, hidden=hidden))
    torch.manual_seed(seed)
    policy = PlacetoPolicy(ctx.num_features, 3, hidden, rounds)
    rng = np.random.default_rng(seed)
    x = rng.random((batch, n, ctx.num_features), dtype=np.float32)
    masks = rng.random((batch, 3, n)) > 0.5
    current = rng.integers(0, n, batch)
    with torch.inference_mode():
        expected = policy(torch.from_numpy(x), ctx.adj, torch.from_numpy(current),
                          torch.from_numpy(masks.astype(np.float32))).numpy()
    got = rollout_logits(rollout_weights(policy), x, current, masks, ctx.rollout_graph(), rounds)
    assert got.shape == (batch, 3)
    assert np.allclose(got, expected, rtol=1e-5, atol=1e-5)


class _ReferenceSum(torch.autograd.Function):
    """`adj @ m` with the gradient `adj_t @ grad` (what the encoder's rounds ran under autograd before `_Rounds`)."""

    @staticmethod
    def forward(ctx, adj, adj_t, m):
        ctx.adj_t = adj_t
        return adj @ m

    @staticmethod
    def backward(ctx, grad):
        return None, None, ctx.adj_t @ grad


@pytest.mark.parametrize("rounds", [1, 3])
def test_rounds_backward_is_autograds_to_the_bit(rounds):
    """`_Rounds`' hand-written backward gives the gradients autograd gives for the same rounds written plainly
    (baddbmm, relu, the sparse sum), bit for bit, so the learning curves stay those of the code before it."""
    g = layered_graph(30, width=4, seed=8)
    ctx = _GraphContext(g, cluster(3), PlacetoHyper(rounds=rounds, hidden=8))
    policy = PlacetoPolicy(ctx.num_features, 3, 8, rounds)
    x = torch.rand(5, g.num_nodes, ctx.num_features, generator=torch.Generator().manual_seed(0))
    weights = torch.rand(g.num_nodes, 5, 16, generator=torch.Generator().manual_seed(1))

    def plain(x):
        n, b = g.num_nodes, x.shape[0]
        h0 = policy.lift(x.transpose(0, 1).reshape(n * b, -1))
        wf, bf, wg, bg = policy.stacked()[:4]
        h = h0.expand(2, n * b, 8)
        for _ in range(rounds):
            m = torch.relu(torch.baddbmm(bf, h, wf))
            agg = _ReferenceSum.apply(ctx.adj.adj, ctx.adj.adj_t, m.reshape(2 * n, b * 8)).reshape(2, n * b, 8)
            h = torch.relu(torch.baddbmm(bg, agg, wg)) + h0
        return torch.cat([h[0], h[1]], dim=-1).reshape(n, b, 16)

    grads = []
    for embed in (plain, lambda x: policy.embed(x, ctx.adj)):
        policy.zero_grad()
        out = embed(x)
        (out * weights).sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in policy.parameters() if p.grad is not None]))
    (out_plain, g_plain), (out_rounds, g_rounds) = grads
    assert torch.equal(out_plain, out_rounds)
    assert len(g_plain) == len(g_rounds) == 12  # lift and the two directions' f and g, weights and biases
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_rounds, strict=True))


@pytest.mark.parametrize("width", [32, 33, 40, 144, 376])
def test_sum_neighbours_is_torchs_product_to_the_bit(width):
    """The learning step's neighbour sums in numba (from 32 columns on) equal torch's CSR product bit for
    bit on a graph where some node has at least 6 parents or children (so that the order of the additions shows)."""
    rng = np.random.default_rng(width)
    n = 40
    pairs = sorted({(int(a), int(b)) for a, b in rng.integers(0, n, (200, 2)) if a < b})
    g = graph([(f"v{i}", 1.0) for i in range(n)], [(f"v{a}", f"v{b}", 1.0) for a, b in pairs])
    ctx = _GraphContext(g, cluster(3), PlacetoHyper(hidden=8))
    assert int(np.diff(ctx.adj.adj.crow_indices().numpy()).max()) >= 6
    m = torch.from_numpy(rng.normal(size=(2 * n, width)).astype(np.float32))
    for adj in (ctx.adj.adj, ctx.adj.adj_t):
        assert torch.equal(_sum_neighbours(adj, m), torch.matmul(adj, m))
