"""The study's results store: one SQLite file, one row per finished (or failed) cell in table `cells`.

The driver is the only writer. Each row is written in one transaction (`INSERT OR REPLACE` keyed on the
cell's stable key) when its cell ends, and the database runs in WAL mode, so a study killed at any moment
(kill -9 included) leaves only whole rows behind: rerunning skips them, and no row is lost or duplicated.
The schema is documented in docs/study-format.md; readers use `read_cells`.

An existing file is checked through a read-only connection before anything is written: a SQLite file of some
other program (a `cells` table of other columns, no `meta` table) or of a newer schema is refused with the
file untouched. Readers (`read_cells`, reports) open the database read-only, so a read-only file or folder
can be reported on. One driver writes a database at a time (`writer_lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from devplace.errors import DevplaceError
from devplace.files import protect

SCHEMA_VERSION = 1

# (column, SQL type); the order is the table's column order. `key` is the primary key.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("key", "TEXT PRIMARY KEY"),  # stable hash of the cell's definition (devplace.study.grid.cell_key)
    ("study", "TEXT"),  # the study's name
    ("graph", "TEXT"),  # the graph spec as written: "cifar10/3", "zoo:resnet50", a file path
    ("family", "TEXT"),  # "cifar10" | "ptb" | "nmt" | "zoo" | "file"
    ("graph_name", "TEXT"),  # CompGraph.name of the prepared graph (NULL when preparation failed)
    ("num_nodes", "INTEGER"),  # nodes of the prepared (coarsened) graph the placer saw
    ("cluster", "TEXT"),  # cluster spec as written (preset name or file path)
    ("sim_model", "TEXT"),  # "devplace" | "placeto": the model step_time_s is measured under
    ("semantics", "TEXT"),  # "op-by-op" | "autograd": the placement semantics placed under (graph/semantics.py)
    ("placer", "TEXT"),
    ("settings", "TEXT"),  # JSON object, sorted keys: the placer settings as the study gave them
    ("order_name", "TEXT"),  # traversal order; "-" for placers that ignore the order
    ("seed", "INTEGER"),
    ("status", "TEXT"),  # "ok" | "failed"
    ("step_time_s", "REAL"),  # step time of the placement under sim_model; NULL when failed
    ("feasible", "INTEGER"),  # 1 when every device's peak memory fits under sim_model, else 0
    ("lower_bound_s", "REAL"),  # devplace.sim.lower_bound of the graph on the cluster
    ("peak_memory_bytes", "TEXT"),  # JSON list, one per device, under sim_model
    ("placement_time_s", "REAL"),  # wall time of the placer call
    ("episodes", "INTEGER"),  # training episodes of RL placers (placeto, seq2seq); NULL otherwise
    ("curve", "TEXT"),  # JSON list: step time after each training episode (RL placers), else NULL
    ("features", "TEXT"),  # JSON object: devplace.hardware.features.graph_features(graph, cluster)
    ("error", "TEXT"),  # "ErrorClass: message" of a failed cell, else NULL
    ("versions", "TEXT"),  # JSON object: devplace, torch, python versions of the process that ran the cell
    ("finished_at", "TEXT"),  # ISO 8601 UTC time the cell ended
    ("wall_s", "REAL"),  # whole cell wall time in its worker (placement + simulations + features)
    ("worker", "TEXT"),  # host:pid of the process that ran the cell
)
COLUMN_NAMES: tuple[str, ...] = tuple(c for c, _ in COLUMNS)
JSON_COLUMNS: frozenset[str] = frozenset({"settings", "peak_memory_bytes", "curve", "features", "versions"})
STATUSES = ("ok", "failed")  # what a cell's row says in `status`


class StoreError(DevplaceError):
    """A results file that is not a devplace study database."""


def connect(db_path: str | Path, *, create: bool = True) -> sqlite3.Connection:
    """Open the results database: with `create` for writing (made if missing, WAL mode, the `cells` table),
    else read-only. An existing file is checked first, read-only, and refused (StoreError, file unchanged)
    when it is not a devplace study database of this schema or, for writing, when it cannot be written."""
    path = Path(db_path)
    protect(path)  # no output of this command may replace the database
    if not create and not path.is_file():
        raise StoreError(f"{path}: no such results database; run `devplace study run ... --db {path}` first")
    exists = path.exists()
    if exists:
        if not path.is_file():
            raise StoreError(f"{path}: not a file; give a results database file as --db")
        if path.stat().st_size:  # a 0-byte file is an empty database: nothing to check
            _check_database(path, writing=create)
    if not create:
        return _open_read_only(path)
    if exists and not os.access(path, os.W_OK):
        raise StoreError(f"{path}: the results database is read-only; make it writable (chmod u+w) or give "
                         "another --db (reports can read it as it is)")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(path.parent, os.W_OK):
        raise StoreError(f"{path}: its folder {path.parent} is read-only (SQLite writes a -wal file beside the "
                         "database); make it writable or give another --db")
    try:
        con = sqlite3.connect(str(path), timeout=30.0)
        con.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable against a killed process in WAL mode (only a power cut can lose the last commits)
        con.execute("PRAGMA synchronous=NORMAL")
        cols = ", ".join(f"{c} {t}" for c, t in COLUMNS)
        with con:
            con.execute(f"CREATE TABLE IF NOT EXISTS cells ({cols})")
            con.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT)")
            con.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        _add_missing_columns(con)
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path}: not a devplace study database ({exc}); give another --db file") from None
    return con


def _open_read_only(path: Path, *, leave_no_files: bool = False) -> sqlite3.Connection:
    """A read-only connection; `immutable` where SQLite cannot even make its shared-memory file (a read-only
    folder), which is exact once no writer is running. With `leave_no_files`, also where the database has no
    -wal file: no writer has it open then, and a read-only connection to a WAL-mode file would otherwise make
    -wal and -shm files beside it and leave them there."""
    uri = path.resolve().as_uri()
    if leave_no_files and not Path(f"{path}-wal").exists():
        return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=30.0)
    try:
        con = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=30.0)
        con.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.OperationalError:
        con = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=30.0)
    return con


def _check_database(path: Path, *, writing: bool) -> None:
    """Refuse a file that is not a devplace study database of this schema, reading it only (and leaving no
    -wal or -shm file beside a refused one)."""
    try:
        con = _open_read_only(path, leave_no_files=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            columns = [r[1] for r in con.execute("PRAGMA table_info(cells)")] if "cells" in tables else []
            version = (con.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
                       if "meta" in tables else None)
            # damage past the header and schema (a torn copy, a bad sector) shows only when its page is read:
            # read them all now, rather than fail in the middle of a study or a report
            health = con.execute("PRAGMA quick_check").fetchone()[0] if tables else "ok"
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path}: not a devplace study database ({exc}); give another --db file") from None
    if not tables:
        return  # an empty SQLite database: the tables are made when writing
    if health != "ok":
        check = " ".join(str(health).split())[:200]  # SQLite's report spans lines
        raise StoreError(f"{path}: damaged results database (SQLite's check: {check}); nothing was changed: restore "
                         "it from a copy, or run the study again into a new --db")
    foreign = [c for c in columns if c not in COLUMN_NAMES]
    if "cells" not in tables or "key" not in columns or foreign:
        what = ("no `cells` table" if "cells" not in tables else
                f"its `cells` table has other columns ({', '.join(foreign[:5]) or 'no key'})")
        raise StoreError(f"{path}: not a devplace study database ({what}); nothing was changed: give another "
                         "--db file")
    if version is None:
        if writing:  # every database devplace writes has its schema version in `meta`
            raise StoreError(f"{path}: not a devplace study database (no schema version in a `meta` table); "
                             "nothing was changed: give another --db file")
        return
    if str(version[0]) != str(SCHEMA_VERSION):
        raise StoreError(f"{path}: results database of schema version {version[0]!r}; this devplace reads "
                         f"version {SCHEMA_VERSION} (a newer devplace wrote it?); nothing was changed: use the "
                         "devplace that wrote it, or give another --db")


@contextlib.contextmanager
def writer_lock(db_path: str | Path) -> Iterator[None]:
    """Hold the database's writer lock (flock on the file) for the block; StoreError when another driver
    holds it. Two drivers on one database would both run every unfinished cell."""
    fd = os.open(str(db_path), os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"{db_path}: another `devplace study run` is writing this database; wait for it to "
                             "finish (it runs every unfinished cell) or give another --db") from None
        yield
    finally:
        # closed only when the run is over: closing a descriptor of the file drops the process's POSIX locks,
        # which SQLite's connections of this file hold
        os.close(fd)


def _add_missing_columns(con: sqlite3.Connection) -> None:
    # a database written by an older devplace gains the newer (nullable) columns, so it still resumes
    have = {row[1] for row in con.execute("PRAGMA table_info(cells)")}
    with con:
        for name, sql_type in COLUMNS:
            if name not in have:
                con.execute(f"ALTER TABLE cells ADD COLUMN {name} {sql_type.replace(' PRIMARY KEY', '')}")


def encode_row(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """The row as a tuple in column order, JSON columns encoded (sorted keys); unknown keys are an error."""
    unknown = set(row) - set(COLUMN_NAMES)
    if unknown:
        raise ValueError(f"unknown result columns: {sorted(unknown)}")  # a bug in the runner, not a user error
    out = []
    for name in COLUMN_NAMES:
        value = row.get(name)
        if name in JSON_COLUMNS and value is not None and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        out.append(value)
    return tuple(out)


def write_cell(con: sqlite3.Connection, row: Mapping[str, Any]) -> None:
    """Write one cell's row in one transaction (replacing a failed row of the same key)."""
    marks = ", ".join("?" for _ in COLUMN_NAMES)
    with con:
        con.execute(f"INSERT OR REPLACE INTO cells ({', '.join(COLUMN_NAMES)}) VALUES ({marks})", encode_row(row))


def finished_keys(con: sqlite3.Connection) -> dict[str, str]:
    """key -> status of every row already in the database."""
    return dict(con.execute("SELECT key, status FROM cells"))


def decode_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row with its JSON columns decoded to Python lists and dicts."""
    out = dict(row)
    for name in JSON_COLUMNS:
        if isinstance(out.get(name), str):
            out[name] = json.loads(out[name])
    return out


def read_cells(db_path: str | Path, *, decode: bool = True, study: str | None = None) -> list[dict[str, Any]]:
    """Every row of table `cells` as a dict (column -> value), ordered by key.

    With `decode` (the default) the JSON columns (settings, peak_memory_bytes, curve, features, versions)
    are decoded to Python objects; without it they stay JSON text as stored. `study` keeps one study's rows.
    """
    con = connect(db_path, create=False)
    try:
        if not con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'cells'").fetchone():
            return []  # an empty database (a 0-byte file, or one a driver created but never wrote): no cells yet
        con.row_factory = sqlite3.Row
        sql, args = "SELECT * FROM cells", ()
        if study is not None:
            sql, args = sql + " WHERE study = ?", (study,)
        rows = [dict(r) for r in con.execute(sql + " ORDER BY key", args)]
    except sqlite3.DatabaseError as exc:  # damage past the header, which the check on opening does not read
        raise StoreError(f"{db_path}: damaged results database ({exc}); restore it or run the study again") from None
    finally:
        con.close()
    for row in rows:
        _check_row(row, db_path)
    return [decode_row(r) for r in rows] if decode else rows


_NUMERIC = tuple(name for name, sql_type in COLUMNS if sql_type in ("REAL", "INTEGER"))
_TEXT = tuple(name for name, sql_type in COLUMNS if sql_type.startswith("TEXT") and name not in JSON_COLUMNS)


def _number(value: Any) -> bool:
    """A JSON number (NaN included: a feature without a cluster is stored as NaN) or null."""
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


# each JSON column: what it must decode to (for the message) and the test of that; the readers (analysis,
# report) rely on these shapes
_JSON_SHAPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "settings": ("a JSON object", lambda v: isinstance(v, dict)),
    "versions": ("a JSON object", lambda v: isinstance(v, dict)),
    "features": ("a JSON object of numbers", lambda v: isinstance(v, dict) and all(map(_number, v.values()))),
    "peak_memory_bytes": ("a JSON list of numbers", lambda v: isinstance(v, list) and all(map(_number, v))),
    "curve": ("a JSON list of numbers", lambda v: isinstance(v, list) and all(map(_number, v))),
}


def _check_row(row: Mapping[str, Any], db_path: str | Path) -> None:
    """Refuse a stored row with a number column that is not a finite number, or a JSON column that is not
    JSON, naming the file, the row's key and the column (SQLite keeps whatever was written)."""
    where = f"{db_path}: row {str(row.get('key'))[:40]!r}"
    for name in _NUMERIC:
        value = row.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value)):
            raise StoreError(f"{where}: column {name!r} must be a finite number, got {value!r:.40}; the database "
                             "was altered: run the study again into a new --db")
    for name in _TEXT:
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            raise StoreError(f"{where}: column {name!r} must be text, got {value!r:.40}; the database was altered: "
                             "run the study again into a new --db")
    if row.get("status") not in STATUSES:
        raise StoreError(f"{where}: column 'status' must be one of {', '.join(STATUSES)}, got "
                         f"{row.get('status')!r:.40}; the database was altered: run the study again into a new --db")
    for name, (shape, test) in _JSON_SHAPES.items():
        if row.get(name) is None:
            continue
        try:
            value = json.loads(row[name])
        except (TypeError, ValueError, RecursionError):  # TypeError: not text at all
            raise StoreError(f"{where}: column {name!r} is not valid JSON; the database was altered: run the "
                             "study again into a new --db") from None
        if not test(value):
            raise StoreError(f"{where}: column {name!r} must hold {shape}, got {row[name]!r:.60}; the database was "
                             "altered: run the study again into a new --db")


def count_rows(db_path: str | Path) -> int:
    """Number of rows in `cells` (0 when the file does not exist yet)."""
    if not Path(db_path).is_file():
        return 0
    try:
        con = _open_read_only(Path(db_path))
    except sqlite3.DatabaseError:
        return 0
    try:
        return int(con.execute("SELECT COUNT(*) FROM cells").fetchone()[0])
    except sqlite3.DatabaseError:
        return 0
    finally:
        con.close()

