"""The same request through `devplace place --model` and `devplace.plan`, side by side (issue 29).

    python benchmarks/entry_points.py [--model gpt2] [--cluster 4xV100-16GB] [--placer auto]

`place --model` is `app.with_torch.place_prepared` on the named model's capture; `devplace.plan` captures the
zoo module built for real (seeded) and, for its micro-batches, the same module on the first batch / M samples
of its inputs. Prints each one's answer (placer kept, schedule, how its micro-batches were costed, step time),
its search's wall time and simulations, the wall time of the whole call (captures included), and whether the two
placements are the same. The study cell and `devplace run --model` are checked against them by
tests/test_one_search.py on a small model.
"""

from __future__ import annotations

import argparse
import time

import devplace
from devplace.app.with_torch import place_prepared, prepare_model
from devplace.hardware.cluster import load_cluster
from devplace.planning import Placed
from devplace.zoo.models import build_model


def line(entry: str, placed: Placed, wall_s: float) -> str:
    """One entry point's answer, as a table row."""
    sched = placed.placement.schedule
    costs = ("-" if sched is None else "captured at batch / M" if sched.microbatch_graph else "whole batch / M")
    return (f"| {entry} | {placed.placer} | {sched.label if sched else 'none'} | {costs} | "
            f"{placed.result.step_time_s:.4f} | {placed.placement_time_s:.1f} | {placed.simulations:,} | "
            f"{wall_s:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="a zoo model")
    ap.add_argument("--cluster", default="4xV100-16GB")
    ap.add_argument("--placer", default="auto")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    t0 = time.perf_counter()
    placed = place_prepared(prepare_model(args.model, cluster=cluster), cluster, placer=args.placer)
    by_cli = time.perf_counter() - t0
    module, inputs, loss_fn = build_model(args.model, seed=0)
    t0 = time.perf_counter()
    plan = devplace.plan(module, inputs, cluster, placer=args.placer, loss_fn=loss_fn)
    by_api = time.perf_counter() - t0
    print(f"{args.model} on {args.cluster}, placer {args.placer}\n")
    print("| entry point | placer kept | schedule | micro-batch costs | step (s) | search wall (s) | simulations "
          "| call wall (s) |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    print(line("place --model", placed, by_cli))
    print(line("devplace.plan", plan.placed, by_api))
    same = plan.placement.assignment == placed.placement.assignment
    print(f"\nsame placement: {same}; same step: {plan.result.step_time_s == placed.result.step_time_s}")


if __name__ == "__main__":
    main()
