"""The `devplace` command: thin typer commands grouped by task (`placement`, `capture`, `study`, `learning`,
`runtime`), each calling one function of the application layer (`devplace.app`) and printing what it returns.
User errors print one line and exit 2; `--json` gives machine-readable output."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.text import Text

from devplace.cli import capture, learning, placement, runtime, study
from devplace.cli.common import one_line
from devplace.errors import DevplaceError

__all__ = ["app", "main"]

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Device placement for model-parallel training.")

# registered here, in the order `devplace --help` lists them
for name, command in (("simulate", placement.simulate_cmd), ("bound", placement.bound_cmd),
                      ("info", placement.info_cmd), ("clusters", placement.clusters_cmd),
                      ("place", placement.place_cmd), ("placers", placement.placers_cmd),
                      ("capture", capture.capture_cmd), ("profile", capture.profile_cmd),
                      ("calibrate", capture.calibrate_cmd), ("order", placement.order_cmd),
                      ("features", placement.features_cmd), ("orders", placement.orders_cmd),
                      ("demo", placement.demo_cmd), ("recommend", placement.recommend_cmd),
                      ("train", learning.train_cmd), ("plot-curve", learning.plot_curve_cmd),
                      ("run", runtime.run_cmd), ("export", runtime.export_cmd)):
    app.command(name)(command)
app.add_typer(capture.zoo_app, name="zoo")
app.add_typer(study.study_app, name="study")


def main() -> None:
    """Entry point of the console script: DevplaceError -> one line on stderr (the message as plain text, not
    markup), exit status 2."""
    try:
        app()
    except DevplaceError as exc:
        Console(stderr=True).print(Text.assemble(("error:", "bold red"), " ", one_line(str(exc))), soft_wrap=True)
        sys.exit(2)
