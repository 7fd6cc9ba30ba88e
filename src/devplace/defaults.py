"""One place for devplace's defaults and for the names of things that are easy to confuse.

The bottom layer: imports nothing, so every package may read it. Change a default here and the CLI, the
Python API (`devplace.place`, `devplace.plan`), the study runner and the benchmarks follow.

Three different things were all called "placeto"; each now has its own name (the old one stays an alias
where users already type it):

- the learned placer `placeto` (Addanki et al. 2019; `devplace place --placer placeto`): unchanged;
- the simulation model of the Placeto paper's simulator (DESIGN.md section 5): `placeto-sim`
  (alias `placeto`), class `devplace.sim.placeto.PlacetoSimModel`;
- the placer's message-passing graph encoder: `placeto-gnn` (alias `placeto`), beside `sage` and `gat`.
"""

from __future__ import annotations

AUTO_PLACER = "auto"
"""Not a placer but a decision, as the order "auto" is: place with each of `AUTO_PLACERS` (each at its default
settings and under the order asked for) and keep the smallest simulated step -- of the full graph as run, for
a coarsened model."""

AUTO_PLACERS = ("m-etf", "greedy", "even-refine")
"""The placers `AUTO_PLACER` tries. On the 21 models of benchmarks/beyond_zoo.py on 4xV100-16GB (none fits one
device) the best of these three fits every model, is at least as fast as the even split on all 21 and within
3.4% of the best of all nine placers run, while m-etf alone found no placement for 6 of them and was slower
than the even split on 7 more (docs/performance.md, "Beyond the zoo")."""

AUTO_PIPELINE = "pipeline"
"""The pipelined candidate of `AUTO_PLACER`: the step in micro-batches (1F1B unless a schedule is asked for, the
micro-batch count chosen among those that divide the batch), compared with `AUTO_PLACERS` whenever the graph
records a batch that can be split, and tried when none of them fits but the parameters do."""

PARALLEL_PLACER = "parallel"
"""What made a parallel plan (dp replicas of a pipeline, `devplace place --dp/--pp/--zero/--recompute`, or placer
auto's parallel candidate): the nested search `devplace.placers.search.search_parallel_plans`, not a registered
placer; a placement's record (`MadeBy.placer`) and placer auto's candidate carry this name."""

AUTO_QUADRATIC_NODES = 5000
"""Placer auto leaves out the placers whose time grows with the square of the graph (greedy) on graphs of more
nodes than this: greedy takes about 4.7 s per order at 5,000 nodes and 68 s at 20,000 on this project's 2-core
machine, and auto would run it under every candidate order."""

AUTO_QUADRATIC_WORK = 5000 * 15_000
"""Placer auto also leaves them out where nodes x (nodes + edges) is above this (a 5,000-node graph of 2 edges per
node): one greedy run simulates the graph nodes x devices times, each simulation costing about nodes + edges, so a
dense graph is as slow as a much larger sparse one -- 600 nodes with 134,770 edges (8.1e7) took greedy 18 s per
order under each of 10 orders, 184 s in all (`devplace place`, this project's 2-core machine, loaded)."""

AUTO_QUADRATIC_SIMULATIONS = 20_000
"""Placer auto also leaves them out where nodes x devices is above this: one greedy run simulates the graph once
per node and device, so a small graph on a very large cluster is slow too -- the 98-node example on 1,024 devices
(100,352 simulations) took greedy 12 s per order, over two minutes under auto's orders (this project's 2-core
machine, loaded); llama-1b's 1,138 groups on 16 devices are 18,208."""

AUTO_SIMULATED_NODES = 10_000_000
"""Placer auto's budget for a placer that refines by simulating (even-refine, setting `max_evals`): at most this
many nodes simulated in all, so `max_evals` is this divided by the nodes of the graph it places when that is
below its default (3,000 simulations up to 3,333 nodes; 500 at 20,000 nodes, where one simulation takes about
27 ms on this project's 2-core machine and 3,000 of them took 81 s). The report says when it applies."""

AUTO_SIMULATED_EDGES = 25_000_000
"""The same budget counted in edges simulated (a simulation's cost grows with edges as with nodes): `max_evals` is
also at most this divided by the edges of the graph -- 185 simulations on 134,770 edges, whose 3,000 took 27 s."""

AUTO_SIMULATED_NODES_FLOOR = 50
"""The fewest simulations that budget leaves a refining placer, however large the graph."""

AUTO_SCHEDULES = ("none",)
"""What `AUTO_PLACER` takes as its `schedule` setting besides a schedule kind: "none", no micro-batches
(only `AUTO_PLACERS`); a kind (gpipe, 1f1b, interleaved-1f1b): only `AUTO_PIPELINE` under it; not given: both
compared."""

DEFAULT_PLACER = AUTO_PLACER
"""The placer `devplace place`, `devplace.place` and `devplace.plan` use when none is named."""

DEFAULT_ORDER = "auto"
"""The traversal order of `devplace place`: a decision, not an order. A cheap placer is placed under every
candidate order and the best simulated step kept; another takes the order model's pick from the graph's
features (`devplace.placers.search.auto_orders`, `devplace.orders.auto`)."""

DEFAULT_SEED = 0
"""The seed of every random choice when none is given."""

CANONICAL_ORDER = "topo"
"""DESIGN.md's canonical traversal order: what takes the place of an order where none is chosen (a placer
without a rule in the order model, `devplace order`, `devplace train`, a study without an `orders` list)."""

FAMILY_MAX_NODES = 300
"""Captured graphs of the study's families (and study cells' zoo models) are coarsened to at most this many
groups unless told otherwise: `devplace zoo family`, `devplace train --family`, a study's `max_nodes`. The seed
study's graphs had a few hundred groups after Placeto's grouping."""

TRAIN_FAMILY_GRAPHS = "0-23"
"""The family members `devplace train --family` trains on when `--graphs` is not given."""

RECOMMEND_PLACER = "greedy"
"""The placer `devplace recommend` and `recommend_order` recommend an order for when none is named."""

SIM_DEVPLACE = "devplace"
"""The reference simulation model (DESIGN.md section 4): the one feasibility is judged under."""

SIM_PLACETO = "placeto-sim"
"""The Placeto paper's simulator (DESIGN.md section 5)."""

SIM_MODELS = (SIM_DEVPLACE, SIM_PLACETO)
"""The simulation models, by their names."""

SIM_MODEL_ALIASES = {"placeto": SIM_PLACETO}
"""Old spellings of simulation models that stay accepted (study files and scripts use them)."""

DEFAULT_SIM_MODEL = SIM_DEVPLACE

LEARNED_PLACER = "placeto"
"""The learned placer `devplace train` trains."""

ENCODER_PLACETO = "placeto-gnn"
"""The Placeto paper's graph encoder (sums over parents and children)."""

ENCODERS = (ENCODER_PLACETO, "sage", "gat")
"""The graph encoders of the learned placer, by their names."""

ENCODER_ALIASES = {"placeto": ENCODER_PLACETO}
"""Old spellings of encoders that stay accepted (policy checkpoints store `placeto`)."""


def sim_model_name(name: str) -> str:
    """The simulation model's name for `name` or one of its aliases (unknown names are returned as given)."""
    return SIM_MODEL_ALIASES.get(name, name)


def encoder_name(name: str) -> str:
    """The encoder's name for `name` or one of its aliases (unknown names are returned as given)."""
    return ENCODER_ALIASES.get(name, name)

# Upper limits of the settings that scale work, checked before any work starts, the limit named in the message
# (docs/limits.md lists them). Far above any useful value, low enough that a typo (10**8 for 8) fails at once
# instead of running for hours or filling memory.
MAX_DEVICES = 1024
"""Devices of a cluster (or `devplace run --devices`): the simulator's channels grow with its square."""

MAX_MICROBATCHES = 1024
"""Micro-batches per step of a pipeline schedule (the simulated graph grows with them)."""

MAX_STEPS = 100_000
"""Timed and warm-up training steps of `devplace run`."""

MAX_EPISODES = 100_000
"""Training episodes of the learned placers (`devplace train --episodes`: rounds of one episode per graph)."""

MAX_ROUNDS = 64
"""Message-passing rounds per direction of placeto's graph encoder."""

MAX_HIDDEN = 4096
"""Embedding width of the learned placers' policies (parameters grow with its square)."""

MAX_SEARCH_STEPS = 1_000_000
"""Simulations a search placer may run: anneal's `steps`, even-refine's `max_evals`, random's `tries` (one
simulation each; a million anneal steps take about 11 minutes on 1,000 ops on this project's 2-core machine)."""

MAX_TIME_LIMIT_S = 86_400.0
"""A placer's wall-clock budget (anneal's and ilp's `time_limit_s`), in seconds: one day."""

MAX_SEQ2SEQ_HIDDEN = 1024
"""seq2seq's `hidden` (its LSTMs' width; parameters and Adam state grow with its square): one iteration of one
sample on a 12-node graph took 19 s and 1.7 GB at 1024, 31 s and 2.8 GB at 2048, and ran past 100 s at 4.4 GB
at 4096 (`devplace place --placer seq2seq --set episodes=1 --set samples=1`, this project's 2-core machine)."""

MAX_SAMPLES = 1024
"""Placements seq2seq samples per iteration (`samples`; its memory grows with them)."""

MAX_PARALLEL = 256
"""Episodes placeto samples side by side (`parallel`; one batched embedding of them all per step)."""

MAX_CHUNKS = 64
"""Model chunks per device of an interleaved pipeline schedule (`chunks`; the stages grow with them)."""

MAX_ILP_NODES = 1000
"""ilp's `max_nodes`: the exact program has a variable per pair of ops, a million at this size."""

MAX_LP_NODES = 1_000_000
"""m-sct's `max_lp_nodes`: the largest graph whose LP relaxation it solves."""


def cpu_cores() -> int:
    """The CPU cores this process may run on: the most worker processes (`study run --workers`, `train
    --workers`) and CPU threads (`--threads`) devplace starts. More only share the same cores, and each worker
    process costs hundreds of MB."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
