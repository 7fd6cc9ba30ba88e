"""Learned placers against the classic ones, side by side in one run (issue 5's benchmark).

The seed study's setting: family graphs (cifar10, ptb, nmt; graph `--index` of each, coarsened to 300
groups), 3 identical devices (`3xGPU-placeto`), both simulation models. For each family, model, learned
placer (placeto, seq2seq) and order (topo, dfs-preorder): the best step time after `--episodes` training
episodes divided by the lower bound, against the best classic placer (m-etf, m-sct, heft, m-topo,
contiguous, single; placed as `devplace place` does, then simulated under the same model); episodes per
second and wall time. Also writes one placeto learning-curve PNG.

The lower bound is devplace's (compute only, no communication); under the placeto model step times also
carry its per-op and per-send pauses, so "/ LB" there is a looser ratio.

Run: `.venv/bin/python benchmarks/rl.py` (10 episodes per run; `--episodes 50`, the study's budget, took
16 minutes on 2 shared CPU cores, the default 2.7 minutes); `--families cifar10 --models placeto`
to narrow it.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from devplace.capture.pipeline import family_graph
from devplace.errors import DevplaceError
from devplace.hardware.cluster import load_cluster
from devplace.orders import traversal_indices
from devplace.placers import place
from devplace.placers.rl.curve import plot_curve, write_curve
from devplace.placers.rl.placeto import PlacetoHyper, train_placeto
from devplace.placers.seq2seq import Seq2SeqConfig, train_seq2seq
from devplace.sim import DevplaceModel, lower_bound
from devplace.sim.placeto import PlacetoModel

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="cifar10,ptb,nmt")
    ap.add_argument("--index", type=int, default=0, help="graph index in each family")
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--orders", default="topo,dfs-preorder")
    ap.add_argument("--models", default="devplace,placeto")
    ap.add_argument("--placers", default="placeto,seq2seq")
    ap.add_argument("--cluster", default="3xGPU-placeto")
    ap.add_argument("--curve", default="docs/img/rl-curve.png", help="learning-curve PNG of the first placeto run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    c = load_cluster(args.cluster)
    orders, sims, placers = args.orders.split(","), args.models.split(","), args.placers.split(",")
    rows, curve_rows = [], None
    t_all = time.perf_counter()
    for fam in args.families.split(","):
        t0 = time.perf_counter()
        g = family_graph(fam, args.index)
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
    pl = [r for r in rows if r[2] == "placeto"]
    if pl:
        eps = float(np.mean([r[8] for r in pl]))
        print(f"\nplaceto: {eps:.2f} episodes/s on average -> 50 episodes in about {50 / eps:.0f} s; "
              f"at least as good as the best classic placer in {sum(r[7] <= 1.0 + 1e-9 for r in pl)} of {len(pl)} "
              "runs")
    if curve_rows is not None and args.curve:
        Path(args.curve).parent.mkdir(parents=True, exist_ok=True)
        write_curve(Path(args.curve).with_suffix(".csv"), curve_rows[1])
        plot_curve(curve_rows[1], args.curve, title=curve_rows[0])
        print(f"wrote {args.curve}")


if __name__ == "__main__":
    main()
