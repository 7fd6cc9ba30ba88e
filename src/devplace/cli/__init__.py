"""The `devplace` command: thin typer commands grouped by task (`placement`, `capture`, `study`, `learning`,
`runtime`), each calling one function of the application layer (`devplace.app`) and printing what it returns.
User errors print one line and exit 2; `--json` gives machine-readable output."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Annotated

import typer
from rich.text import Text

from devplace.cli import capture, learning, placement, runtime, study
from devplace.cli.common import guarded_console, one_line, quiet_libraries
from devplace.errors import DevplaceError
from devplace.files import MAX_INPUT_ENV, begin_command, end_command, set_max_input_bytes

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


@app.callback()
def global_options(
    ctx: typer.Context,
    max_input_bytes: Annotated[int | None, typer.Option(
        "--max-input-bytes", help=f"refuse input files longer than this many bytes (default 256 MiB, at most 1 TiB; "
                                  f"same as {MAX_INPUT_ENV}=N, which it sets for the command's worker processes "
                                  "too)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="show the warnings of the libraries devplace uses "
                                          "(torch, matplotlib, Ray), hidden otherwise")] = False,
) -> None:
    """Options of every command, given before the command's name."""
    begin_command()  # from here on, every file read is an input no output of this command may replace
    ctx.call_on_close(end_command)
    quiet_libraries(not verbose)
    if max_input_bytes is not None:
        set_max_input_bytes(max_input_bytes)


def _error(message: str) -> None:
    guarded_console(stderr=True).print(Text.assemble(("error:", "bold red"), " ", one_line(message)), soft_wrap=True)


def main() -> None:
    """Entry point of the console script: a DevplaceError or a usage error (a bad option value, a missing
    argument, an unknown command) -> one line on stderr (the message as plain text, not markup), exit status
    2."""
    try:
        code = app(standalone_mode=False)
    except DevplaceError as exc:
        _error(str(exc))
        sys.exit(2)
    except typer.TyperException as exc:  # click's usage errors, raised to us without standalone mode
        # a group called without a command has printed its help already (typer tells it by its class name too)
        if type(exc).__name__ != "NoArgsIsHelpError":
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _error(exc.format_message().rstrip(".") + hint)
        sys.exit(exc.exit_code)
    except typer.Abort:  # Ctrl-D at a prompt
        sys.exit(1)
    except OSError as exc:
        if exc.errno not in _OUTPUT_ERRNOS:
            raise
        # standard output on a full disk or a closed pipe: one line, and nothing more written to it at exit
        _error(f"cannot write the output: {exc.strerror}")
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


# the errors of writing an output that are the machine's, not devplace's (files devplace writes report them as
# OutputPathError; these are standard output's)
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EPIPE, errno.EIO, errno.EFBIG})
