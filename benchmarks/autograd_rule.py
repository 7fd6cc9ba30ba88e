"""The autograd rule (issue 11): placed vs as-run step time of zoo models, with the rule off and on.

Rule off is the placement as placers made it before: the coarse graph placed node by node
(`place(..., semantics="op-by-op")`), expanded to the full graph; autograd then runs each backward and
optimizer op on its forward op's device (`runtime_placement`), so the step that runs ("as run") differs from
the one reported ("placed") and may be over memory. Rule on is `place_expanded` (what `devplace.plan` and
`devplace place --model` use): tie classes placed as one decision and the full graph checked as run, so the
two are one number. The ratio is rule on / rule off as run (< 1: the rule's placement runs faster).

Run: `.venv/bin/python benchmarks/autograd_rule.py [--models gpt2,bert-base,inception_v3,llama-1b:1]
[--cluster 4xV100-16GB] [--placers m-etf,m-sct,m-topo,contiguous,greedy]` (`name:B` sets the batch; a
model `tv:NAME:B` is torchvision's NAME, not in the zoo, with a cross-entropy loss at batch B on 224x224
images). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from devplace.capture.pipeline import Prepared, prepare, zoo_prepared
from devplace.capture.torch_capture import capture
from devplace.errors import DevplaceError
from devplace.graph.placement import runtime_placement
from devplace.hardware.presets import PRESETS
from devplace.placers import place, place_expanded
from devplace.sim import simulate
from devplace.units import fmt_time


def _ms(result) -> str:  # type: ignore[no-untyped-def]
    return fmt_time(result.step_time_s) + ("" if result.feasible else " OVER MEMORY")


def _prepared(item: str, max_nodes: int) -> Prepared:
    if item.startswith("tv:"):
        import torchvision

        from devplace.zoo.models import ClassifierLoss

        _, name, batch = item.split(":")
        with torch.device("meta"):  # shapes only: the capture runs on fake tensors
            model = ClassifierLoss(getattr(torchvision.models, name)(weights=None))
            inputs = (torch.randn(int(batch), 3, 224, 224), torch.zeros(int(batch), dtype=torch.long))
        return prepare(capture(model, inputs, optimizer="adam", name=f"{name}-b{batch}"), max_nodes=max_nodes)
    name, _, batch = item.partition(":")
    return zoo_prepared(name, batch=int(batch) if batch else None, max_nodes=max_nodes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2,bert-base,inception_v3,llama-1b:1,llama-1b:2")
    parser.add_argument("--cluster", default="4xV100-16GB")
    parser.add_argument("--placers", default="m-etf,m-sct,m-topo,contiguous,greedy")
    parser.add_argument("--max-nodes", type=int, default=300)
    args = parser.parse_args()
    cluster = PRESETS[args.cluster]()
    print(f"cluster {args.cluster}, coarsened to {args.max_nodes} groups\n")
    print("| model | placer | rule off: placed | rule off: as run | rule on: placed = as run | on / off as run "
          "| ties | placement time on (s) |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for item in args.models.split(","):
        prep = _prepared(item, args.max_nodes)
        label = prep.full.name
        for placer in args.placers.split(","):
            try:
                coarse = place(prep.graph, cluster, placer=placer, semantics="op-by-op")
                off = prep.coarsening.expand(coarse)
                off_placed = simulate(prep.full, cluster, off)
                off_run = simulate(prep.full, cluster, runtime_placement(prep.full, off))
                off_cells = f"{_ms(off_placed)} | {_ms(off_run)}"
            except DevplaceError as exc:
                off_run = None
                off_cells = f"{type(exc).__name__} | -"
            t0 = time.perf_counter()
            try:
                on = place_expanded(prep.coarsening, prep.full, cluster, placer=placer)
            except DevplaceError as exc:
                print(f"| {label} | {placer} | {off_cells} | {type(exc).__name__} | - | - | - |")
                continue
            elapsed = time.perf_counter() - t0
            as_run = simulate(prep.full, cluster, runtime_placement(prep.full, on.placement))
            same = as_run.step_time_s == on.result.step_time_s
            cell = _ms(on.result) + ("" if same else f" (as run {_ms(as_run)}!)")
            ratio = (f"{on.result.step_time_s / off_run.step_time_s:.2f}" if off_run is not None and off_run.feasible
                     else "-")
            print(f"| {label} | {placer} | {off_cells} | {cell} | {ratio} | {on.coarse.meta.get('ties', '-')} "
                  f"| {elapsed:.1f} |", flush=True)


if __name__ == "__main__":
    main()
