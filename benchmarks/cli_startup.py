"""Startup time of `devplace --help`: this tree against another source tree, side by side.

    python benchmarks/cli_startup.py --before /path/to/other/src [--runs 9]

Runs `python -m devplace --help` alternately with each tree on PYTHONPATH (so machine load hits both alike)
and prints the median wall time of each and their ratio, plus the modules each loads. Make the other tree
with e.g. `git archive <commit> src | tar -x -C /tmp/before`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "src"


def once(src: Path) -> float:
    """Wall time of one `python -m devplace --help` with `src` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "devplace", "--help"], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def modules(src: Path) -> int:
    """How many modules `import devplace.cli` loads."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", "import sys, devplace.cli; print(len(sys.modules), "
                          "'torch' in sys.modules)"], env=env, check=True, capture_output=True, text=True)
    return int(out.stdout.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the other tree's src/ folder")
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    once(args.before), once(HERE)  # warm the file cache and numba's
    before, after = [], []
    for _ in range(args.runs):
        before.append(once(args.before))
        after.append(once(HERE))
    b, a = statistics.median(before), statistics.median(after)
    print(f"| tree | median of {args.runs} (s) | modules loaded |")
    print("|---|---|---|")
    print(f"| before ({args.before}) | {b:.3f} | {modules(args.before)} |")
    print(f"| this tree | {a:.3f} | {modules(HERE)} |")
    print(f"this tree / before = {a / b:.3f}")


if __name__ == "__main__":
    main()
