"""Regret of `--order auto` on held-out graphs, side by side with always-`topo`, one fixed order and the
per-graph oracle, from a study database.

Regret = step time with the chosen order / step time with the graph's best order - 1 (oracle: 0); "try 3" is
`--order auto --try 3` (the best of the 3 highest-ranked orders, as the study measured them). The tree is
refitted without the held-out graph (leave-one-graph-out) or family (leave-one-family-out) each time.

    .venv/bin/python benchmarks/order_regret.py out/study/quick.sqlite
"""

from __future__ import annotations

import sys

from devplace.study.analysis import build_units, load_rows, units_by_placer
from devplace.study.recommend import validate


def main(db: str) -> None:
    units = build_units(load_rows(db))
    print(f"{db}: {len(units)} graph x placer units")
    print(f"{'placer':<12} {'held out':<8} {'graphs':>6} {'auto':>8} {'try 3':>8} {'topo':>8} {'fixed':>8} "
          f"{'oracle':>7} {'auto acc':>8} {'topo acc':>8}")
    for placer, us in units_by_placer(units).items():
        for label, key in (("graph", lambda u: u.graph), ("family", lambda u: u.family)):
            v = validate(us, key)
            print(f"{placer:<12} {label:<8} {v['units']:>6} {v['regret']:>8.2%} {v['try_regret']:>8.2%} "
                  f"{v['topo_regret']:>8.2%} "
                  f"{v['fixed_regret']:>8.2%} {0:>7.0%} {v['accuracy']:>8.0%} {v['topo_accuracy']:>8.0%}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/study/quick.sqlite")
