"""Study definitions: a TOML file (or a built-in preset) naming graphs, clusters, the simulation model,
placers with their settings, orders and seeds. docs/study-format.md has a commented example.

Every key is checked when the file is read: unknown keys, unknown placers, settings, orders, clusters,
families and zoo models are errors that say what is wrong and what is allowed, before any cell runs.
"""

from __future__ import annotations

import glob
import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from devplace.defaults import AUTO_PLACER, CANONICAL_ORDER, DEFAULT_SEED, DEFAULT_SIM_MODEL, FAMILY_MAX_NODES
from devplace.errors import DevplaceError
from devplace.files import env_limit, read_limited
from devplace.graph.parallel import ParallelAsk
from devplace.graph.semantics import SemanticsError, parse_semantics
from devplace.planning import MAX_SEED

PRESETS: tuple[str, ...] = ("quick", "seed", "seed-full", "paper", "extended")
NO_ORDER = "-"  # order_name of cells whose placer ignores the traversal order

_TOP_KEYS = ("name", "description", "graphs", "max_nodes", "clusters", "sim_model", "semantics", "placers", "orders",
             "seeds")
PARALLEL_SETTING = "parallel"  # a placer's `parallel` table, kept among a cell's settings
_PLACER_KEYS = ("name", "settings", "orders", "seeds", "parallel")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
# A study's grid is counted before any cell is made: a typo such as `seeds = 100000000` would otherwise fill
# memory (gigabytes) before the first cell runs. The paper preset has 10,560 cells.
MAX_CELLS_ENV = "DEVPLACE_MAX_CELLS"
DEFAULT_MAX_CELLS = 1_000_000


class StudyError(DevplaceError):
    """A study definition that cannot be run: bad TOML, unknown key, placer, order, cluster or graph."""


@dataclass(frozen=True)
class GraphRef:
    """One graph of the study. `spec` is what the rows' `graph` column holds ("cifar10/3", "zoo:resnet50",
    or a file path as written); `path` is the resolved file for family "file"."""

    spec: str
    family: str  # "cifar10" | "ptb" | "nmt" | "zoo" | "file"
    name: str = ""  # zoo model name
    index: int = -1  # family member
    path: Path | None = None

    def identity(self) -> str:
        """What a cell key hashes for this graph: the spec, plus the file's content hash for files."""
        if self.path is None:
            return self.spec
        return f"{self.spec}#{_file_sha(self.path)}"


@dataclass(frozen=True)
class ClusterRef:
    """One cluster: a preset name or a cluster file (`spec` as written, `source` what load_cluster takes)."""

    spec: str
    source: str

    def identity(self) -> str:
        path = Path(self.source)
        return self.spec if self.source == self.spec and not path.is_file() else f"{self.spec}#{_file_sha(path)}"


@dataclass(frozen=True)
class PlacerEntry:
    """A placer with its settings; `orders` and `seeds` override the study's when given."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    orders: tuple[str, ...] | None = None
    seeds: tuple[int, ...] | None = None
    log_path: Path | None = None  # the `log` setting resolved against the TOML's folder (inside it)
    policy_path: Path | None = None  # the `policy` setting (a file to read) resolved against the TOML's folder


@dataclass(frozen=True)
class StudySpec:
    """A parsed, checked study definition."""

    name: str
    graphs: tuple[GraphRef, ...]
    clusters: tuple[ClusterRef, ...]
    placers: tuple[PlacerEntry, ...]
    orders: tuple[str, ...]
    seeds: tuple[int, ...]
    sim_model: str = DEFAULT_SIM_MODEL
    max_nodes: int | None = FAMILY_MAX_NODES
    description: str = ""
    # placement semantics for every cell ("op-by-op" | "autograd"); None: each graph's own (family graphs:
    # op-by-op, zoo models: autograd, graph files: as written), `devplace.graph.semantics`
    semantics: str | None = None
    source: str = ""  # the file or preset it came from


def _file_sha(path: Path) -> str:
    return hashlib.sha256(read_limited(path)).hexdigest()[:16]


def cell_limit(limit: int | None = None) -> int:
    """The grid-size limit: `limit` when given, else DEVPLACE_MAX_CELLS, else 1,000,000 cells."""
    return env_limit(limit, env=MAX_CELLS_ENV, default=DEFAULT_MAX_CELLS, name="max_cells", unit="cells",
                     example=10 * DEFAULT_MAX_CELLS, error=StudyError)


def too_many_cells(where: str, count: int, limit: int) -> StudyError:
    """The error for a grid of `count` cells over the limit, saying how to raise it."""
    return StudyError(f"{where}: the study has {count:,} cells, more than the limit of {limit:,}; check the seed "
                      f"counts and member ranges, or raise the limit with `devplace study run --max-cells N` or "
                      f"{MAX_CELLS_ENV}=N (max_cells=N in Python)")


def load_study(path_or_name: str | Path, *, preset: bool = False, max_cells: int | None = None) -> StudySpec:
    """Read a study TOML file, or with `preset` the built-in study of that name (`PRESETS`).

    A file longer than the input limit (DEVPLACE_MAX_INPUT_BYTES) or a grid of more than `max_cells` cells
    (default DEVPLACE_MAX_CELLS or 1,000,000) is refused.
    """
    if preset:
        name = str(path_or_name)
        if name not in PRESETS:
            raise StudyError(f"unknown study preset {name!r}; presets: {', '.join(PRESETS)}")
        text = (resources.files("devplace.study") / "presets" / f"{name}.toml").read_text(encoding="utf-8")
        return parse_study(text, base_dir=Path.cwd(), source=f"preset:{name}", max_cells=max_cells)
    path = Path(path_or_name)
    if not path.is_file():
        raise StudyError(f"{path}: no such study file; give a TOML study definition or --preset "
                         f"({', '.join(PRESETS)})")
    try:
        text = read_limited(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StudyError(f"{path}: not UTF-8 text (byte {exc.start}); save the study file as UTF-8") from None
    except DevplaceError as exc:
        raise StudyError(str(exc)) from None
    return parse_study(text, base_dir=path.resolve().parent, source=str(path), max_cells=max_cells)


def parse_study(text: str, *, base_dir: Path, source: str = "<string>", max_cells: int | None = None) -> StudySpec:
    """Parse and check a study definition given as TOML text; relative file paths resolve against base_dir.

    Every key and every placer setting (its type, and names such as anneal's `start`) is checked here, and
    the grid is counted before any seed list is made: more than `max_cells` cells (default
    DEVPLACE_MAX_CELLS or 1,000,000) is an error.
    """
    limit = cell_limit(max_cells)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise StudyError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise StudyError(f"{source}: not valid TOML: arrays or tables nested too deep") from None
    where = source
    _known(doc, _TOP_KEYS, where)
    for required in ("graphs", "clusters", "placers"):
        if required not in doc:
            raise StudyError(f"{where}: missing key {required!r} (a study needs graphs, clusters and placers)")
    name = doc.get("name", Path(source).stem if not source.startswith("preset:") else source[7:])
    if not isinstance(name, str) or not name:
        raise StudyError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise StudyError(f"{where}: 'description' must be a string")
    sim_model = doc.get("sim_model", DEFAULT_SIM_MODEL)
    from devplace.sim import MODELS

    if sim_model not in MODELS:
        raise StudyError(f"{where}: sim_model {sim_model!r} is unknown; choose one of: {', '.join(MODELS)}")
    semantics = doc.get("semantics")
    if semantics is not None:
        try:
            semantics = parse_semantics(semantics, f"{where}: semantics").value
        except SemanticsError as exc:
            raise StudyError(str(exc)) from None
    max_nodes = doc.get("max_nodes", FAMILY_MAX_NODES)
    if max_nodes == 0:
        max_nodes = None  # 0: no coarsening beyond colocation
    if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 2):
        raise StudyError(f"{where}: max_nodes must be an integer >= 2 (or 0 for no coarsening), got {max_nodes!r}")
    graphs = _graphs(doc["graphs"], base_dir, where)
    clusters = _clusters(doc["clusters"], base_dir, where)
    orders = _orders(doc.get("orders", [CANONICAL_ORDER]), f"{where}: orders")
    seeds = _seeds(doc.get("seeds", [DEFAULT_SEED]), f"{where}: seeds", limit)
    placers = _placers(doc["placers"], where, base_dir, limit)
    spec = StudySpec(name=name, graphs=graphs, clusters=clusters, placers=placers, orders=orders, seeds=seeds,
                     sim_model=sim_model, max_nodes=max_nodes, description=description, source=source,
                     semantics=semantics)
    count = count_cells(spec)
    if count > limit:
        raise too_many_cells(where, count, limit)
    return spec


def count_cells(spec: StudySpec) -> int:
    """How many cells `spec` expands to, computed without making them."""
    from devplace.placers.search import request_walks_order

    per_pair = 0
    for p in spec.placers:
        orders = 1 if not request_walks_order(p.name) else len(p.orders if p.orders is not None else spec.orders)
        per_pair += orders * len(p.seeds if p.seeds is not None else spec.seeds)
    return len(spec.graphs) * len(spec.clusters) * per_pair


def _known(doc: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise StudyError(f"{where}: unknown key {', '.join(map(repr, unknown))}; allowed keys: {', '.join(known)}")


def _str_list(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise StudyError(f"{what} must be a non-empty list of strings, got {value!r}"[:300])
    return value


def _graphs(value: Any, base_dir: Path, where: str) -> tuple[GraphRef, ...]:
    from devplace.zoo.families import FAMILIES, FAMILY_SIZE

    out: list[GraphRef] = []
    for item in _str_list(value, f"{where}: graphs"):
        if item.startswith("zoo:"):
            from devplace.zoo.models import MODELS

            model = item[4:]
            if model not in MODELS:
                raise StudyError(f"{where}: graphs: unknown zoo model {model!r}; zoo models: {', '.join(MODELS)}")
            out.append(GraphRef(spec=item, family="zoo", name=model))
            continue
        fam, slash, members = item.partition("/")
        if slash and fam in FAMILIES and not (base_dir / item).exists():
            for i in _members(members, FAMILY_SIZE, f"{where}: graphs: {item!r}"):
                out.append(GraphRef(spec=f"{fam}/{i}", family=fam, index=i))
            continue
        matches = sorted(glob.glob(str(base_dir / item))) if glob.has_magic(item) else [str(base_dir / item)]
        files = [Path(m) for m in matches if Path(m).is_file()]
        if not files:
            raise StudyError(f"{where}: graphs: {item!r} is not a zoo model (zoo:NAME), a family member "
                             f"({'|'.join(FAMILIES)}/0-{FAMILY_SIZE - 1}) or an existing graph file")
        for f in files:
            spec = item if not glob.has_magic(item) else (str(f.relative_to(base_dir)) if f.is_relative_to(base_dir)
                                                          else str(f))
            out.append(GraphRef(spec=spec, family="file", path=f))
    seen: set[str] = set()
    for g in out:
        if g.spec in seen:
            raise StudyError(f"{where}: graphs: {g.spec!r} is listed twice")
        seen.add(g.spec)
    return tuple(out)


def _members(text: str, size: int, what: str) -> list[int]:
    """'3' -> [3]; '0-7' -> 0..7; '0,4,9-11' -> [0, 4, 9, 10, 11]."""
    out: list[int] = []
    for part in text.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise StudyError(f"{what}: members must be like 3, 0-31 or 0,4,9-11")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo or hi >= size:
            raise StudyError(f"{what}: member range {part!r} is outside 0-{size - 1}")
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


def _clusters(value: Any, base_dir: Path, where: str) -> tuple[ClusterRef, ...]:
    from devplace.hardware.cluster import load_cluster
    from devplace.hardware.presets import PRESETS as CLUSTER_PRESETS

    out = []
    for item in _str_list(value, f"{where}: clusters"):
        source = item if item in CLUSTER_PRESETS else str(base_dir / item)
        if item not in CLUSTER_PRESETS and not Path(source).is_file():
            raise StudyError(f"{where}: clusters: {item!r} is neither a cluster preset nor a file; presets: "
                             f"{', '.join(CLUSTER_PRESETS)}")
        try:
            load_cluster(source)
        except DevplaceError as exc:
            raise StudyError(f"{where}: clusters: {exc}") from None
        out.append(ClusterRef(spec=item, source=source))
    if len({c.spec for c in out}) != len(out):
        raise StudyError(f"{where}: clusters: a cluster is listed twice")
    return tuple(out)


def _orders(value: Any, what: str) -> tuple[str, ...]:
    from devplace.orders import ORDERS

    if value == "all":
        return ORDERS
    names = _str_list(value, what)
    # "auto" (devplace's default: the search picks the order) beside the orders, to compare with them
    bad = [n for n in names if n not in ORDERS and n != "auto"]
    if bad:
        raise StudyError(f"{what}: unknown order {', '.join(map(repr, bad))}; orders: {', '.join(ORDERS)} "
                         f"(or \"all\"), and auto")
    if len(set(names)) != len(names):
        raise StudyError(f"{what}: an order is listed twice")
    return tuple(names)


def _seeds(value: Any, what: str, limit: int) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise StudyError(f"{what}: a seed count must be >= 1, got {value}")
        if value > limit:  # before making the tuple: 10^8 seeds alone take gigabytes
            raise too_many_cells(what, value, limit)
        return tuple(range(value))
    if isinstance(value, list) and len(value) > limit:
        raise too_many_cells(what, len(value), limit)
    if (not isinstance(value, list) or not value
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED for s in value)):
        raise StudyError(f"{what} must be a count N (seeds 0..N-1) or a list of integers from 0 to {MAX_SEED}, got "
                         f"{value!r}"[:300])
    if len(set(value)) != len(value):
        raise StudyError(f"{what}: a seed is listed twice")
    return tuple(value)


def _placers(value: Any, where: str, base_dir: Path, limit: int) -> tuple[PlacerEntry, ...]:
    from devplace.placers.search import request_settings

    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise StudyError(f"{where}: placers must be a list of names or of [[placers]] tables")
    out = []
    for i, item in enumerate(value):
        what = f"{where}: placers[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict):
            raise StudyError(f"{what} must be a placer name or a table with name and settings")
        _known(item, _PLACER_KEYS, what)
        name = item.get("name")
        if not isinstance(name, str):
            raise StudyError(f"{what}: 'name' (the placer) is missing")
        try:
            accepted = request_settings(name)
        except DevplaceError as exc:
            raise StudyError(f"{what}: {exc}") from None
        settings = item.get("settings", {})
        if not isinstance(settings, dict):
            raise StudyError(f"{what}: settings must be a table, got {settings!r}")
        unknown = sorted(set(settings) - set(accepted))
        if unknown:
            listed = ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "none"
            raise StudyError(f"{what}: placer {name!r} has no setting {', '.join(map(repr, unknown))}; "
                             f"its settings: {listed}")
        _check_settings(name, settings, what)
        if "parallel" in item:
            settings = {**settings, PARALLEL_SETTING: _parallel(item["parallel"], f"{what}: parallel")}
        log_path = _log_path(settings["log"], base_dir, what) if "log" in settings else None
        policy_path = _policy_path(settings["policy"], base_dir, what) if "policy" in settings else None
        orders = _orders(item["orders"], f"{what}: orders") if "orders" in item else None
        seeds = _seeds(item["seeds"], f"{what}: seeds", limit) if "seeds" in item else None
        out.append(PlacerEntry(name=name, settings=dict(settings), orders=orders, seeds=seeds, log_path=log_path,
                               policy_path=policy_path))
    return tuple(out)


def _parallel(value: Any, what: str) -> dict[str, Any]:
    """A placer's `parallel` table (`dp`, `pp`, `zero`, `recompute`, each optional: what `devplace place --dp/--pp/
    --zero/--recompute` fix; an empty table is `--parallel`), checked as a `ParallelAsk`."""
    if not isinstance(value, dict):
        raise StudyError(f"{what} must be a table of dp, pp, zero, recompute (each optional), got {value!r}"[:300])
    unknown = sorted(set(value) - set(ParallelAsk.__dataclass_fields__))
    if unknown:
        raise StudyError(f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; it takes dp, pp, zero, recompute")
    try:
        ParallelAsk(**value)
    except DevplaceError as exc:
        raise StudyError(f"{what}: {exc}") from None
    return dict(value)


def parallel_ask(settings: dict[str, Any]) -> tuple[ParallelAsk | None, dict[str, Any]]:
    """A cell's parallel plans asked for (its placer's `parallel` table, kept among its settings so the cell's key
    holds it) and the placer's own settings without it."""
    rest = {k: v for k, v in settings.items() if k != PARALLEL_SETTING}
    table = settings.get(PARALLEL_SETTING)
    return (ParallelAsk(**table) if isinstance(table, dict) else None), rest


def _check_settings(placer: str, settings: dict[str, Any], what: str) -> None:
    """The placer's settings as `PlacerSpec.validate` checks them (known, of the declared types, finite, in range
    and under their limits, names that name something), placer "auto"'s as `check_auto_placer` does: so a typo
    fails when the study is read, not when its first cell runs."""
    from devplace.placers.registry import get_placer
    from devplace.placers.search import check_request_settings

    try:
        if placer == AUTO_PLACER:
            check_request_settings(placer, settings)
        else:
            get_placer(placer).validate(settings)
    except DevplaceError as exc:
        raise StudyError(f"{what}: {exc}") from None


def _log_path(value: Any, base_dir: Path, what: str) -> Path:
    """The `log` setting as a path inside the study's folder (base_dir); a path that leaves it is refused."""
    root = base_dir.resolve()
    path = (root / str(value)).resolve()
    if not path.is_relative_to(root) or path == root:
        raise StudyError(f"{what}: setting 'log' is {value!r}, which leads outside the study's folder {root}; give "
                         "a file name inside it, e.g. \"logs/curve.csv\" (each cell writes its own file beside it)")
    return path


def _policy_path(value: Any, base_dir: Path, what: str) -> Path:
    """The `policy` setting (a trained policy to start from) as an existing file; a relative path is read from
    the study's folder (base_dir), as graph and cluster files are, wherever the study is run from."""
    path = base_dir / str(value)
    if not path.is_file():
        raise StudyError(f"{what}: setting 'policy' is {value!r}, but {path} is not a file; give a policy "
                         "checkpoint (`devplace train -o`), relative to the study's folder")
    return path
