"""Learned placers against the classic ones, side by side in one run (issue 5's benchmark).

The seed study's setting: family graphs (cifar10, ptb, nmt; graphs `--indices` of each, coarsened to 300
groups and placed op by op, as the families say), 3 identical devices (`3xGPU-placeto`), both simulation
models. For each family, model, learned placer (placeto, seq2seq) and order (topo, dfs-preorder): the best
step time after `--episodes` training episodes divided by the lower bound, against the best classic placer
(m-etf, m-sct, heft, m-topo, contiguous, single; placed as `devplace place` does, then simulated under the
same model); episodes per second and wall time. Also writes one placeto learning-curve PNG.

The lower bound is devplace's (compute only, no communication); under the placeto model step times also
carry its per-op and per-send pauses, so "/ LB" there is a looser ratio.

Issue 22 item 3 ran `--indices 0-3 --episodes 50 --models placeto --placers placeto --orders topo`: per
family, the geometric mean of learned / best classic and the runs where it is at most 1.

Run: `.venv/bin/python benchmarks/rl.py` (10 episodes per run; `--episodes 50`, the study's budget, took
16 minutes on 2 shared CPU cores, the default 2.7 minutes); `--families cifar10 --models placeto`
to narrow it.
Prints Markdown tables.

`--speed COMMIT`: placeto's episodes per second and learning curves, this checkout against the code of git commit
COMMIT (checked out into a temporary `git worktree`, removed after), side by side in one run: the same graph
(captured once here, handed to both as a file), cluster, order and seeds, each run in a fresh process with both
simulators' numba kernels compiled before the clock starts (until 2026-12-06 only the devplace model's: a placeto-sim
run paid its kernels' compilation inside the clock where the cache was cold) and, since issue 33's second session,
after a warm-up run of 2 episodes with the same settings (the placer's own kernels: the compiled rollout forward
loads from numba's cache in its first call), the two alternating per seed so
that both see the same load on a shared machine. Both run with `start=--speed-start` (default "device0": the answer
then depends on what was learned, and the start costs nothing), so both learn the same thing;
`--speed-episodes` episodes per run; `--speed-hyper` names the hyperparameter set (a commit without named sets
runs only `devplace`, "n/a" otherwise) and `--speed-settings` adds settings (JSON) to both. Episodes per second
are printed by wall clock and by the process's CPU time (the machine is shared: CPU time is the steadier figure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from devplace.capture.pipeline import family_graph
from devplace.errors import DevplaceError
from devplace.files import set_force
from devplace.graph import save_graph
from devplace.hardware.cluster import load_cluster
from devplace.orders import traversal_indices
from devplace.placers import place
from devplace.placers.rl.curve import plot_curve, write_curve
from devplace.placers.rl.placeto import PlacetoHyper, train_placeto
from devplace.placers.rl.trainer import parse_indices
from devplace.placers.seq2seq import Seq2SeqConfig, train_seq2seq
from devplace.sim import DevplaceModel, lower_bound
from devplace.sim.placeto import PlacetoModel
from devplace.zoo.families import FAMILY_SIZE

CLASSIC = ("m-etf", "m-sct", "heft", "m-topo", "contiguous", "single")


def classic_best(g, c, models: dict) -> dict[str, tuple[str, float]]:
    """Per simulation model: the classic placer (at order topo) with the smallest step time, and that time."""
    best: dict[str, tuple[str, float]] = {m: ("-", math.inf) for m in models}
    for name in CLASSIC:
        try:
            p = place(g, c, placer=name, order="topo", seed=0)
        except DevplaceError:
            continue
        devices = p.to_array(g, c.num_devices)
        for m, model in models.items():
            t = model.run(devices).step_time_s
            if t < best[m][1]:
                best[m] = (name, t)
    return best


# one timed placeto run, in a fresh process; only API that both this checkout and older ones have
_TIMED_RUN = """
import json, sys, time
import numpy as np
from devplace.graph import load_graph
from devplace.hardware.cluster import load_cluster
from devplace.orders import traversal_indices
from devplace.placers.rl.placeto import PlacetoHyper, train_placeto
from devplace.placers.rl.trainer import parse_indices
from devplace.sim import DevplaceModel
from devplace.sim.placeto import PlacetoModel
path, cluster, order, seed, episodes, extra = sys.argv[1:]
g, c = load_graph(path), load_cluster(cluster)
for Model in (DevplaceModel, PlacetoModel):  # compile (or load) both simulators' numba kernels first
    Model(g, c).run(np.zeros(g.num_nodes, dtype=np.int64))
o = traversal_indices(g, order, int(seed), cluster=c)
settings = json.loads(extra)
name = settings.pop("hyper", "devplace")
import devplace.placers.rl.placeto as P
if hasattr(P, "resolve_hyper"):  # named sets (issue 33)
    hyper = P.resolve_hyper(name, episodes=int(episodes), **settings)
elif name == "devplace":
    hyper = PlacetoHyper(episodes=int(episodes), **settings)
else:
    print(json.dumps(None))
    sys.exit(0)
import dataclasses
# warm-up: a 2-episode run of the same settings (a training and a greedy episode either way) compiles or loads every
# kernel of the placer (numba's, torch's first calls) before the clock
train_placeto(g, c, o, int(seed), dataclasses.replace(hyper, episodes=2))
t0, c0 = time.perf_counter(), time.process_time()
run = train_placeto(g, c, o, int(seed), hyper)
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "curve": run.curve,
                  "best": run.step_time_s, "start": run.start_step_time_s, "episodes": len(run.rows)}))
"""


def _timed_run(src: Path, graph_path: Path, args: argparse.Namespace, seed: int, extra: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _TIMED_RUN, str(graph_path), args.cluster, args.speed_order,
                          str(seed), str(args.speed_episodes), json.dumps(extra)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def speed(args: argparse.Namespace) -> None:
    """Episodes per second and learning curves of placeto: this checkout against commit `args.speed`."""
    root = Path(__file__).resolve().parent.parent
    g = family_graph(args.families.split(",")[0], parse_indices(args.indices, FAMILY_SIZE)[0])
    seeds = [int(s) for s in args.speed_seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        graph_path = Path(tmp) / "graph.json"
        save_graph(g, graph_path)
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(old), args.speed], check=True,
                       capture_output=True)
        try:
            rows = []
            for i, seed in enumerate(seeds):
                extra = {"start": args.speed_start, "hyper": args.speed_hyper, **json.loads(args.speed_settings)}
                pair = [("before", old / "src", extra), ("after", root / "src", extra)]
                res = dict((name, _timed_run(src, graph_path, args, seed, settings))
                           for name, src, settings in (pair if i % 2 == 0 else pair[::-1]))
                rows.append((seed, res["before"], res["after"]))
                print(f"  seed {seed}: before {_rate(res['before'], 'wall_s')} ep/s, "
                      f"after {_rate(res['after'], 'wall_s')} ep/s (wall)", flush=True)
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(old)], check=True)
    print(f"\nplaceto on {g.name} ({g.num_nodes} groups), {args.cluster}, order {args.speed_order}, "
          f"hyperparameter set {args.speed_hyper}, settings {args.speed_settings}, episodes={args.speed_episodes}; "
          f"before = commit {args.speed}, after = this checkout; load average {os.getloadavg()[0]:.1f} at the end "
          f"on {os.cpu_count()} CPUs; ep/s counts every episode run (training, evaluations, the final argmax)\n")
    print("| seed | ep/s wall before | after | ep/s CPU before | after | CPU after / before | "
          "last episode / start before | after | best / start before | after |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for seed, b, a in rows:
        print(f"| {seed} | {_rate(b, 'wall_s')} | {_rate(a, 'wall_s')} | {_rate(b, 'cpu_s')} | {_rate(a, 'cpu_s')} "
              f"| {_ratio(a, b)} | {_rel(b, 'last')} | {_rel(a, 'last')} | {_rel(b, 'best')} | {_rel(a, 'best')} |")
    both = [(b, a) for _, b, a in rows if b is not None and a is not None]
    if both:
        same = sum(b["curve"] == a["curve"] for b, a in both)
        print(f"\nidentical learning curves (every episode's step time equal): {same} of {len(both)} seeds; "
              f"mean speed-up {np.mean([b['wall_s'] / a['wall_s'] for b, a in both]):.2f}x wall, "
              f"{np.mean([b['cpu_s'] / a['cpu_s'] for b, a in both]):.2f}x CPU")


def _rate(run: dict | None, clock: str) -> str:
    """Episodes per second of a timed run by `clock` ("wall_s" or "cpu_s"); "n/a" where the code could not run it."""
    return "n/a" if run is None else f"{run['episodes'] / run[clock]:.2f}"


def _ratio(after: dict | None, before: dict | None) -> str:
    return "n/a" if after is None or before is None else f"{after['cpu_s'] / before['cpu_s']:.2f}"


def _rel(run: dict | None, what: str) -> str:
    """The last training episode's (`what` "last") or the answer's ("best") step time over the start's."""
    if run is None:
        return "n/a"
    return f"{(run['curve'][-1] if what == 'last' else run['best']) / run['start']:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="cifar10,ptb,nmt")
    ap.add_argument("--indices", default="0", help="graph indices in each family, e.g. 0 or 0-3")
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--orders", default="topo,dfs-preorder")
    ap.add_argument("--models", default="devplace,placeto")
    ap.add_argument("--placers", default="placeto,seq2seq")
    ap.add_argument("--cluster", default="3xGPU-placeto")
    ap.add_argument("--curve", default="docs/img/rl-curve.png", help="learning-curve PNG of the first placeto run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speed", metavar="COMMIT", help="time placeto against this commit's code (see above)")
    ap.add_argument("--speed-episodes", type=int, default=10)
    ap.add_argument("--speed-seeds", default="0,1,2")
    ap.add_argument("--speed-order", default="topo")
    ap.add_argument("--speed-start", default="device0", help="placeto's start in both runs (device0 or classic)")
    ap.add_argument("--speed-hyper", default="devplace",
                    help="placeto's hyperparameter set in both runs (a commit without named sets runs devplace only)")
    ap.add_argument("--speed-settings", default="{}", help='more placeto settings for both runs, JSON: {"hidden": 8}')
    args = ap.parse_args()
    if args.speed:
        speed(args)
        return
    c = load_cluster(args.cluster)
    orders, sims, placers = args.orders.split(","), args.models.split(","), args.placers.split(",")
    rows, curve_rows = [], None
    t_all = time.perf_counter()
    for fam, index in [(f, i) for f in args.families.split(",") for i in parse_indices(args.indices, FAMILY_SIZE)]:
        t0 = time.perf_counter()
        g = family_graph(fam, index)
        capture_s = time.perf_counter() - t0
        models = {"devplace": DevplaceModel(g, c), "placeto": PlacetoModel(g, c)}
        lb = lower_bound(g, c).value_s
        classic = classic_best(g, c, {m: models[m] for m in sims})
        print(f"# {g.name}: {g.num_nodes} groups, {g.num_edges} edges, LB {lb * 1e3:.3f} ms, "
              f"captured in {capture_s:.1f} s", flush=True)
        for sim in sims:
            for placer in placers:
                for order in orders:
                    o = traversal_indices(g, order, args.seed, cluster=c)
                    t0 = time.perf_counter()
                    if placer == "placeto":
                        run = train_placeto(g, c, o, args.seed, PlacetoHyper(episodes=args.episodes, sim_model=sim))
                        devices, episodes = run.devices, args.episodes + 1
                        if curve_rows is None:
                            curve_rows = (f"placeto on {g.name}, {sim} model, order {order}", run.rows)
                    else:
                        res = train_seq2seq(g, c, o, seed=args.seed,
                                            config=Seq2SeqConfig(episodes=args.episodes, sim_model=sim))
                        devices, episodes = res.devices, args.episodes
                        if res.fallback:
                            devices = np.asarray(place(g, c, placer="m-etf").to_array(g, c.num_devices))
                    wall = time.perf_counter() - t0
                    ok = DevplaceModel(g, c).run(devices).feasible
                    t = models[sim].run(devices).step_time_s
                    cname, ct = classic[sim]
                    rows.append((g.name, sim, placer, order, t / lb, cname, ct / lb, t / ct, episodes / wall, wall,
                                 ok))
                    print(f"  {sim:8s} {placer:8s} {order:13s} step/LB {t / lb:6.3f}  best classic {cname} "
                          f"{ct / lb:6.3f}  ratio {t / ct:5.3f}  {episodes / wall:5.2f} ep/s  {wall:6.1f} s"
                          + ("" if ok else "  INFEASIBLE"), flush=True)
    print(f"\n{args.episodes} training episodes per run, cluster {args.cluster}, seed {args.seed}; "
          f"total {time.perf_counter() - t_all:.0f} s\n")
    print("| graph | model | placer | order | step / LB | best classic | its step / LB | learned / classic "
          "| episodes/s | wall s |")
    print("| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3f} | {r[5]} | {r[6]:.3f} | {r[7]:.3f} | {r[8]:.2f} "
              f"| {r[9]:.1f} |")
    for fam in args.families.split(","):  # per family: geometric mean of learned / best classic, and wins
        for sim in sims:
            for placer in placers:
                fr = [r[7] for r in rows if r[0].startswith(f"{fam}-") and r[1] == sim and r[2] == placer]
                if fr:
                    print(f"{fam} {sim} {placer}: learned / best classic {math.exp(np.mean(np.log(fr))):.3f} "
                          f"(geometric mean), at most 1.0 on {sum(x <= 1.0 + 1e-9 for x in fr)} of {len(fr)} runs")
    pl = [r for r in rows if r[2] == "placeto"]
    if pl:
        eps = float(np.mean([r[8] for r in pl]))
        print(f"\nplaceto: {eps:.2f} episodes/s on average -> 50 episodes in about {50 / eps:.0f} s; "
              f"at least as good as the best classic placer in {sum(r[7] <= 1.0 + 1e-9 for r in pl)} of {len(pl)} "
              "runs")
    if curve_rows is not None and args.curve:
        Path(args.curve).parent.mkdir(parents=True, exist_ok=True)
        write_curve(Path(args.curve).with_suffix(".csv"), curve_rows[1])
        set_force(True)  # the benchmark's own figure: replaced even where an older devplace drew it
        plot_curve(curve_rows[1], args.curve, title=curve_rows[0])
        print(f"wrote {args.curve}")


if __name__ == "__main__":
    main()
