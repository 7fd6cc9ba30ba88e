"""Learning curves: one CSV row per episode (and graph), written by `devplace train` and the learned placers'
`log` setting (`devplace place --log`), drawn by `devplace plot-curve`."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from devplace.errors import DevplaceError
from devplace.files import CSV_CURVE, output_file, read_limited, save_png

COLUMNS = ("episode", "graph", "step_time_s", "best_step_time_s", "entropy", "wall_s", "greedy")


class CurveError(DevplaceError):
    """A learning-curve file that cannot be read or written."""


def write_curve(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write `rows` (dicts with the COLUMNS keys) as CSV to `path`; returns the path."""
    path = Path(path)
    with output_file(path, "--log", CSV_CURVE, newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    return path


def read_curve(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a curve CSV, numbers parsed."""
    path = Path(path)
    if not path.exists():
        raise CurveError(f"no learning-curve file {path} (write one with `devplace train ... --log {path}`)")
    try:
        text = read_limited(path).decode("utf-8")
    except UnicodeDecodeError:
        raise CurveError(f"{path} is not a learning curve: not UTF-8 text") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = []
    try:  # csv refuses a field over its limit (128 KiB): no learning curve has one
        have = reader.fieldnames or []
        missing = [c for c in ("episode", "graph", "step_time_s", "best_step_time_s") if c not in have]
        if missing:
            raise CurveError(f"{path} is not a learning curve: no column {', '.join(missing)}")
        for raw in reader:
            row: dict[str, Any] = {"graph": raw["graph"]}
            for k in COLUMNS:
                if k != "graph" and raw.get(k) not in (None, ""):
                    row[k] = float(raw[k])
            rows.append(row)
    except (csv.Error, ValueError) as exc:
        raise CurveError(f"{path}:{reader.line_num}: not a learning-curve row ({exc})") from None
    return rows


def plot_curve(rows: list[dict[str, Any]], output: str | Path, title: str = "") -> Path:
    """Draw step time per episode (thin) and best so far (thick), one colour per graph, and the mean entropy;
    step times divided by each graph's first-episode step time when there are several graphs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise CurveError("the learning curve has no rows")
    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    relative = len(graphs) > 1
    fig, (ax, ax_e) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[3, 1])
    for i, g in enumerate(graphs):
        mine = [r for r in rows if r["graph"] == g and not r.get("greedy")]
        if not mine:
            continue
        scale = mine[0]["step_time_s"] if relative and mine[0]["step_time_s"] > 0 else 1.0
        ep = [r["episode"] for r in mine]
        colour = f"C{i % 10}"
        ax.plot(ep, [r["step_time_s"] / scale for r in mine], color=colour, lw=0.7, alpha=0.6)
        ax.plot(ep, [r["best_step_time_s"] / scale for r in mine], color=colour, lw=2,
                label=g if len(graphs) <= 8 else None)
    ax.set_ylabel("step time / first episode" if relative else "simulated step time (s)")
    if len(graphs) <= 8:
        ax.legend(fontsize=8)
    episodes = sorted({r["episode"] for r in rows if not r.get("greedy")})
    ent = [sum(r.get("entropy", math.nan) for r in rows if r["episode"] == e and not r.get("greedy"))
           / max(1, sum(1 for r in rows if r["episode"] == e and not r.get("greedy"))) for e in episodes]
    ax_e.plot(episodes, ent, color="k", lw=1)
    ax_e.set_ylabel("entropy (nats)")
    ax_e.set_xlabel("episode")
    ax.set_title(title or "learning curve (thin: episode's final state, thick: best so far)", fontsize=10)
    fig.tight_layout()
    output = Path(output)
    save_png(fig, output, "--output", dpi=110)
    plt.close(fig)
    return output
