"""Learned-placer commands: train, plot-curve."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from devplace import app
from devplace.cli.common import SIM_MODEL_HELP, SeedOpt, SemanticsOpt, busy, require_cluster, rounds_bar, say
from devplace.defaults import (
    CANONICAL_ORDER,
    DEFAULT_SEED,
    ENCODER_ALIASES,
    ENCODERS,
    FAMILY_MAX_NODES,
    LEARNED_PLACER,
    TRAIN_FAMILY_GRAPHS,
)
from devplace.hardware.cluster import load_cluster
from devplace.units import fmt_time

ENCODER_HELP = (f"graph encoder: {', '.join(ENCODERS)}"
                + "".join(f" ({alias}: same as {name})" for alias, name in ENCODER_ALIASES.items()))
# The placer's hyperparameters default to None here, meaning "the placer's default": they are written once, in
# devplace.placers.rl.placeto.PlacetoHyper (which needs torch, so it is not imported to build this command).
PLACER_DEFAULT = "; default: the placer's (`devplace placers`)"


def train_cmd(
    graphs: Annotated[list[Path] | None, typer.Argument(help="graph files to train on (or use --family)")] = None,
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="cluster preset name or cluster JSON file")] = "",
    placer: Annotated[str, typer.Option(help=f"the learned placer to train ({LEARNED_PLACER} only)")
                      ] = LEARNED_PLACER,
    family: Annotated[str | None, typer.Option(help="train on a study family: cifar10, ptb or nmt")] = None,
    indices: Annotated[str, typer.Option("--graphs", help="family graph indices, e.g. 0-23 or 0,3,5-7")
                       ] = TRAIN_FAMILY_GRAPHS,
    max_nodes: Annotated[int, typer.Option("--max-nodes", help="coarsen family graphs to this many groups")
                         ] = FAMILY_MAX_NODES,
    order: Annotated[str | None, typer.Option(help="traversal order of the episodes (see `devplace orders`; "
                                                   f"default: {CANONICAL_ORDER})")] = None,
    episodes: Annotated[int | None, typer.Option(help=f"rounds: one sampling episode per graph each{PLACER_DEFAULT}")
                        ] = None,
    seed: SeedOpt = DEFAULT_SEED,
    semantics: SemanticsOpt = None,
    encoder: Annotated[str | None, typer.Option(help=ENCODER_HELP + PLACER_DEFAULT)] = None,
    hidden: Annotated[int | None, typer.Option(help=f"embedding width{PLACER_DEFAULT}")] = None,
    rounds: Annotated[int | None, typer.Option(help=f"message-passing rounds per direction{PLACER_DEFAULT}")] = None,
    memory_penalty: Annotated[float | None, typer.Option("--memory-penalty", help="reward penalty per relative "
                                                                                  f"overflow{PLACER_DEFAULT}")] = None,
    sim_model: Annotated[str | None, typer.Option("--sim-model", help=f"simulator of the reward; {SIM_MODEL_HELP}"
                                                                      f"{PLACER_DEFAULT}")] = None,
    lr: Annotated[float | None, typer.Option(help=f"Adam learning rate{PLACER_DEFAULT}")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="write the policy checkpoint here")] \
    = Path("policy.pt"),
    resume: Annotated[Path | None, typer.Option(help="continue training this checkpoint")] = None,
    log: Annotated[Path | None, typer.Option(help="write the learning curve CSV here")] = None,
    backend: Annotated[str, typer.Option(help="rollout workers: local (processes) or ray")] = "local",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: start Ray locally)")] = None,
    workers: Annotated[int, typer.Option(help="rollout workers (local: 1 runs in this process)")] = 1,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
) -> None:
    """Train one placeto policy over several graphs (a family's, or GRAPHS files) and save it for
    `devplace place --placer placeto --set policy=policy.pt` on graphs it never saw."""
    tasks = app.torch_tasks()
    tasks.check_learned_placer(placer)
    require_cluster(cluster)
    c = load_cluster(cluster)
    app.check_outputs(output=output, log=log)  # before capturing a family, not only before training
    with busy(f"capturing {family} graphs", quiet or family is None):
        gs = tasks.training_graphs(graphs or [], family=family, indices=indices, max_nodes=max_nodes)
    settings: dict[str, Any] = dict(order=order, episodes=episodes, seed=seed, encoder=encoder, hidden=hidden,
                                    rounds=rounds, memory_penalty=memory_penalty, sim_model=sim_model, lr=lr,
                                    workers=workers, backend=backend, address=address, resume=resume, output=output,
                                    log=log, semantics=semantics)
    with rounds_bar(f"training on {len(gs)} graphs", episodes, quiet) as update:
        if update is not None:
            def report(done: int, total: int, rows: list[dict[str, Any]]) -> None:
                best = sum(r["best_step_time_s"] for r in rows) / max(1, len(rows))
                update(done, f"training on {len(gs)} graphs, mean best {fmt_time(best)}", total)

            settings["progress"] = report
        result = tasks.train_policy(gs, c, **settings)
    say(f"trained placeto ({result.num_parameters} parameters) for {result.episodes_done} rounds on "
        f"{len(gs)} graphs; best / start step time (geometric mean) {tasks.mean_best_ratio(result):.3f}; "
        f"wrote {result.output}" + (f" and {log}" if log else ""))


def plot_curve_cmd(
    curve: Annotated[Path, typer.Argument(help="learning curve CSV from `devplace train --log` or --set log=...")],
    output: Annotated[Path, typer.Option("-o", "--output", help="write the PNG here")] = Path("curve.png"),
) -> None:
    """Draw a learning curve: step time per episode and best so far (per graph), and the policy's entropy."""
    rows = app.torch_tasks().plot_learning_curve(curve, output)
    say(f"wrote {output} ({rows} rows)")
