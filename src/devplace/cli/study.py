"""Study commands: study run, study report, study verify."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from devplace import app
from devplace.cli.common import ForceOpt, console, say
from devplace.study.spec import DEFAULT_MAX_CELLS, MAX_CELLS_ENV, PRESETS

StudyArg = Annotated[Path | None, typer.Argument(help="study definition (TOML); or use --preset")]
PresetOpt = Annotated[str | None, typer.Option("--preset", help=f"built-in study: {', '.join(PRESETS)}")]

study_app = typer.Typer(no_args_is_help=True, help="The traversal-order study: run a grid of cells, report on it.")


@study_app.command("run")
def study_run_cmd(
    study: StudyArg = None,
    preset: PresetOpt = None,
    db: Annotated[Path, typer.Option("--db", help="SQLite results file (created; finished cells are skipped)")] = Path(
        "study.sqlite"),
    backend: Annotated[str, typer.Option("--backend", help="local (process pool) or ray")] = "local",
    workers: Annotated[int, typer.Option("--workers", help="parallel cells (processes or Ray CPUs)")] = 1,
    address: Annotated[str | None, typer.Option("--address", help="Ray cluster address (ray backend only)")] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="rerun cells recorded as failed")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="no progress bar")] = False,
    max_cells: Annotated[int | None, typer.Option(
        "--max-cells", help=f"refuse a grid of more cells than this (default {DEFAULT_MAX_CELLS:,}; same as "
                            f"{MAX_CELLS_ENV}=N)")] = None,
) -> None:
    """Run every unfinished cell of a study and write one row per cell to --db; rerun to resume."""
    ran = app.torch_tasks().study_run(study, preset=preset, db=db, backend=backend, workers=workers, address=address,
                                      retry_failed=retry_failed, progress=not quiet, max_cells=max_cells)
    console.print(ran)


@study_app.command("report")
def study_report_cmd(
    db: Annotated[Path, typer.Argument(help="results database written by `devplace study run`")],
    out: Annotated[Path, typer.Option("-o", "--output", help="folder for report.md, results.csv, plots")] = Path(
        "study-report"),
    force: ForceOpt = False,
) -> None:
    """Write a study's report: report.md (results section), results.csv, PNG plots and the fitted order model."""
    written = app.torch_tasks().study_report(db, out)
    say(f"wrote {len(written)} files to {out}: " + ", ".join(p.name for p in written))


@study_app.command("verify")
def study_verify_cmd(
    study: StudyArg = None,
    preset: PresetOpt = None,
    db: Annotated[Path, typer.Option("--db", help="SQLite results file written by `devplace study run`")] = Path(
        "study.sqlite"),
    cells: Annotated[int, typer.Option("--cells", help="how many stored cells to draw and rerun")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="seed of the draw")] = 0,
    key: Annotated[list[str] | None, typer.Option("--key", help="rerun this cell (its `key`; repeatable) "
                                                                 "instead of a draw")] = None,
) -> None:
    """Rerun stored cells of a study and compare each with its row, bit for bit (step time, learning curve); exit
    status 1 when one differs."""
    found = app.torch_tasks().study_verify(study, preset=preset, db=db, cells=cells, seed=seed, keys=tuple(key or ()))
    console.print(found)
    if not found.same:
        raise typer.Exit(1)
