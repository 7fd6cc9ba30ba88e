"""What every command module shares: the console, argument and option types, JSON output, progress display,
and `--set key=value` parsing. Presentation only: the work is done by `devplace.app`."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleOptions, RenderableType, RenderHook, RenderResult
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.segment import Segment
from rich.text import Text

from devplace import app
from devplace.defaults import AUTO_PIPELINE, AUTO_PLACER, AUTO_PLACERS, SIM_MODEL_ALIASES, SIM_MODELS
from devplace.errors import DevplaceError
from devplace.files import json_text, set_force
from devplace.graph.semantics import parse_semantics
from devplace.planning import check_seed


def _escaped(text: str, keep: str = "") -> str:
    """`text` with every control character (terminal escape codes, newlines unless kept) written as an escape."""
    return "".join(ch if ch.isprintable() or ch in keep else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


class _Escaping:
    """A renderable as printed, with control characters in its text written as escapes (rich's own styles and
    cursor moves are control segments, kept): a graph, device or node name cannot drive the terminal."""

    def __init__(self, inner: RenderableType) -> None:
        self.inner = inner

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for seg in console.render(self.inner, options):
            yield seg if seg.control or seg.text.isprintable() else Segment(_escaped(seg.text, "\n\t"), seg.style)


class _EscapeHook(RenderHook):
    def process_renderables(self, renderables: list[Any]) -> list[Any]:
        return [_Escaping(r) for r in renderables]


def guarded_console(**kwargs: Any) -> Console:
    """A rich console (keyword arguments as Console's) that writes user text's control characters as escapes."""
    out = Console(**kwargs)
    out.push_render_hook(_EscapeHook())
    return out


console = guarded_console()

GraphArg = Annotated[Path, typer.Argument(help="graph file (devplace.graph/1 JSON), or `example` for the bundled one")]
ClusterArg = Annotated[str, typer.Argument(help="cluster preset name (see `devplace clusters`) or cluster JSON file")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]
CostsOpt = Annotated[Path | None, typer.Option("--costs", help="cost table from `devplace profile` (measured op times "
                                               "and this machine's per-op, per-action and per-transfer overheads) "
                                               "for --model's ops and the cluster's devices of its kind")]
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="zoo model to capture (see `devplace zoo list`), "
                                              "or a custom one: package.module:factory, a function returning "
                                              "(module, example_inputs[, loss_fn])")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", help="training precision of the captured step: fp32, bf16 "
                                              "or fp16 (parameters, buffers and inputs cast to it; default: the "
                                              "model's own); with --amp, the autocast dtype (default bf16)")]
AmpOpt = Annotated[bool, typer.Option("--amp", help="capture under torch.autocast (mixed precision: forward and loss "
                                      "in --dtype, parameters as they are)")]
BatchOpt = Annotated[int | None, typer.Option(help="batch size (default: the model's)")]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", help="sequence length (default: the model's)")]
MaxNodesOpt = Annotated[int | None, typer.Option("--max-nodes", help="coarsen to at most this many groups")]
OptimizerOpt = Annotated[str, typer.Option(help="optimizer of the captured step: adam, sgd or none")]
PlacerOpt = Annotated[str, typer.Option(help=f"placer name (see `devplace placers`), or {AUTO_PLACER} (the best of "
                                              f"{', '.join(AUTO_PLACERS)} and, where the batch can be split, "
                                              f"{AUTO_PIPELINE}, each at its defaults; --schedule none: no "
                                              "micro-batches)")]
SeedOpt = Annotated[int, typer.Option(help="seed for every random choice", callback=check_seed)]


def output_path(raw: str | Path) -> Path:
    """An output file option's value (typer's `parser`; a default arrives as a Path): a name ending in / names a
    folder, refused here because the path typer makes drops the slash (and a file named like the folder would be
    written)."""
    if isinstance(raw, str) and raw.endswith(("/", os.sep)):
        raise typer.BadParameter(f"{raw} names a folder (it ends in /); give a file name, e.g. {raw}out.json")
    return Path(raw)


TraceOpt = Annotated[Path | None, typer.Option(parser=output_path, help="write a Chrome trace-event JSON (Perfetto)")]
PlotOpt = Annotated[Path | None, typer.Option(parser=output_path, help="write a Gantt chart PNG")]
ScheduleOpt = Annotated[str | None, typer.Option(help="micro-batch schedule: gpipe, 1f1b or interleaved-1f1b (with "
                                                      "--placer pipeline, default 1f1b; with --placer auto, only "
                                                      "pipelines under it), or none (--placer auto: no "
                                                      "micro-batches); same as --set schedule=KIND")]
MicrobatchesOpt = Annotated[int | None, typer.Option(help="--placer pipeline: micro-batches per step (default: the "
                                                          "best of 1-32 by simulation); same as --set microbatches=M")]
ChunksOpt = Annotated[int | None, typer.Option(help="--placer pipeline with interleaved-1f1b: model chunks per device "
                                                    "(default 2); same as --set chunks=V")]



def check_semantics(value: str | None) -> str | None:
    """--semantics checked before any work (a capture takes a while): None, "op-by-op" or "autograd"."""
    return None if value is None else parse_semantics(value, "--semantics").value


SemanticsOpt = Annotated[str | None, typer.Option(
    "--semantics", callback=check_semantics,
    help="placement semantics, overriding the graph's: op-by-op (every node on its own; a tensor used on another "
         "device is a copy) or autograd (backward and optimizer ops with their forward op, as PyTorch runs a "
         "step). Default: the graph's own -- autograd for a captured --model, op-by-op for family graphs and "
         "for graph files that say nothing")]

SIM_MODEL_HELP = (f"simulation model: {' or '.join(SIM_MODELS)}"
                  + "".join(f" ({alias}: same as {name})" for alias, name in SIM_MODEL_ALIASES.items()))


def print_json(doc: Any) -> None:
    """Print `doc` as indented JSON (NaN and infinities as null: JSON has neither)."""
    sys.stdout.write(json_text(doc, indent=1) + "\n")


def one_line(text: str) -> Text:
    """User text as printed: never read as rich markup, and control characters (newlines, terminal escape
    codes) written as escapes, so that a message stays one line and cannot drive the terminal."""
    return Text(_escaped(text))


def say(text: str) -> None:
    """Print a line of text that may hold user text (names, paths): never read as markup."""
    console.print(text, markup=False)


def warn(message: str) -> None:
    """Print a one-line warning on stderr."""
    guarded_console(stderr=True).print(Text.assemble(("warning:", "yellow"), " ", one_line(message)), soft_wrap=True)


def busy(message: str, quiet: bool) -> Any:
    """A spinner with `message` while a long step runs, unless `quiet` or stdout is not a terminal (where it
    would only leave a blank line)."""
    return nullcontext() if quiet or not console.is_terminal else console.status(one_line(message))


@contextmanager
def progress_bar(description: str, quiet: bool, label: str = "placing {task.description}",
                 ) -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar; yields the `progress(done, total)` callback long tasks call (None if `quiet`
    or stdout is not a terminal)."""
    if quiet or not console.is_terminal:
        yield None
        return
    columns = (TextColumn(label, markup=False), BarColumn(), TaskProgressColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def show(fraction: float, candidate: str) -> None:
            # one bar for the whole search (placer auto, order auto): the share done of all of it, and which
            # candidate runs, so that it neither restarts with each candidate nor hides which one is slow
            bar.update(task, completed=fraction, total=1.0,
                       description=f"{description}: {candidate}" if candidate else description)
        yield app.SearchProgress(show)


@contextmanager
def rounds_bar(description: str, total: int | None, quiet: bool) -> Iterator[Callable[..., None] | None]:
    """A transient done/total bar; yields `update(done, description, total)` (None if `quiet` or stdout is not a
    terminal). `total` None: not known yet, until the first update gives it."""
    if quiet or not console.is_terminal:
        yield None
        return
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done, text, total: bar.update(task, completed=done, description=text, total=total)


def _force(value: bool) -> bool:
    set_force(value)
    return value


# --force acts through devplace.files (which every output goes through), set as the option is parsed: the command
# itself only declares it
ForceOpt = Annotated[bool, typer.Option("--force", callback=_force, help="replace an existing output file devplace "
                                        "did not write, or a symbolic link (the link, not its target); an input "
                                        "of the command is never replaced")]

_QUIET_ENV = "PYTHONWARNINGS"


def quiet_libraries(quiet: bool) -> None:
    """Keep the warnings of third-party libraries (Python warnings and the loggers of torch and Ray) off the
    user's output when `quiet` (the default; `devplace --verbose` shows them), in worker processes too. devplace's
    own warnings are printed lines, not Python warnings, so they stay."""
    if not quiet:
        return
    warnings.simplefilter("ignore")
    warnings.filterwarnings("default", module=r"devplace\.")  # devplace's own (e.g. a traced forward's mismatch)
    os.environ.setdefault(_QUIET_ENV, "ignore")  # inherited by a study's workers and `run --pipeline`'s stages
    for name in ("torch", "ray", "matplotlib", "py.warnings"):
        logging.getLogger(name).setLevel(logging.ERROR)


def parse_settings(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values are read as JSON when they parse (numbers, true/false, null), else text."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise DevplaceError(f"--set expects key=value, got {pair!r} (e.g. --set steps=2000)")
        try:
            settings[key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[key] = raw
    return settings


def require_cluster(cluster: str) -> None:
    """`--cluster` is required by this command."""
    if not cluster:
        raise DevplaceError("--cluster is required (a preset from `devplace clusters` or a cluster JSON file)")
