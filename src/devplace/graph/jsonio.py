"""Reading and writing devplace's versioned JSON documents (shared by every `format`), and the input-size
limit of every file devplace reads.

Input files are read through `read_limited`, which stops after the limit (default 256 MiB, far above any real
graph, cluster, placement or study file): a wrong path such as /dev/zero or a multi-GB file then fails with an
error instead of filling memory. Raise the limit with the environment variable DEVPLACE_MAX_INPUT_BYTES, the
command-line flag `devplace --max-input-bytes N` (`set_max_input_bytes`), or the functions' `max_bytes` keyword.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from devplace.errors import FormatError

MAX_INPUT_ENV = "DEVPLACE_MAX_INPUT_BYTES"
DEFAULT_MAX_INPUT_BYTES = 256 * 2**20


def env_limit(value: int | None, *, env: str, default: int, name: str, unit: str, example: int,
              error: type[Exception] = FormatError) -> int:
    """A positive whole-number limit: `value` (the keyword `name`) when given, else the environment variable
    `env`, else `default`; anything else raises `error` saying how to set it (`example` is shown)."""
    where = name
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        try:
            value = int(raw.replace("_", ""))
        except ValueError:
            raise error(f"{env} is {raw!r}; set it to a whole number of {unit}, e.g. {env}={example}") from None
        where = env
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{where} must be a whole number of {unit} >= 1, got {value!r}")
    return value


def max_input_bytes(max_bytes: int | None = None) -> int:
    """The input-size limit: `max_bytes` when given, else DEVPLACE_MAX_INPUT_BYTES, else 256 MiB."""
    return env_limit(max_bytes, env=MAX_INPUT_ENV, default=DEFAULT_MAX_INPUT_BYTES, name="max_bytes", unit="bytes",
                     example=4 * DEFAULT_MAX_INPUT_BYTES)


def set_max_input_bytes(max_bytes: int) -> int:
    """Raise (or lower) the input-size limit of this process and of every process it starts (a study's workers
    read graph and cluster files too): the limit is kept in DEVPLACE_MAX_INPUT_BYTES, which they inherit.
    Returns the limit; a value that is not a whole number >= 1 raises FormatError and changes nothing."""
    limit = env_limit(max_bytes, env=MAX_INPUT_ENV, default=DEFAULT_MAX_INPUT_BYTES, name="--max-input-bytes",
                      unit="bytes", example=4 * DEFAULT_MAX_INPUT_BYTES)
    os.environ[MAX_INPUT_ENV] = str(limit)
    return limit


def read_limited(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of `path`, refusing a file (or device, or pipe) longer than the input limit.

    At most limit + 1 bytes are read, so an endless source such as /dev/zero fails quickly. Raises
    FormatError for a missing, unreadable or too large file.
    """
    path = Path(path)
    limit = max_input_bytes(max_bytes)
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise FormatError(f"{path}: longer than the input limit of {limit:,} bytes; check that it is the right "
                          f"file, or raise the limit with `devplace --max-input-bytes N` or {MAX_INPUT_ENV}=N (bytes)")
    return data


def read_json(path: str | Path, expected_format: str, *, max_bytes: int | None = None) -> dict[str, Any]:
    """Parse `path` and check that its `format` key is `expected_format` (same family, same version).

    Malformed JSON is reported with the file, line and column; a missing or unknown `format` with the
    versions this devplace reads. Files longer than the input limit (`max_bytes`, default
    `max_input_bytes()`) are refused before parsing.
    """
    path = Path(path)
    data = read_limited(path, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: not UTF-8 text (byte {exc.start}); JSON files must be UTF-8") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
    except _DuplicateKey as exc:
        raise FormatError(f"{path}: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer of more than 4300 digits; nesting too deep
        raise FormatError(f"{path}: malformed JSON: {str(exc) or type(exc).__name__}") from None
    check_format(doc, expected_format, str(path))
    return doc


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (json would silently keep the last value)."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        where = f" (in the object with \"id\": {doc['id']!r})" if isinstance(doc.get("id"), str) else ""
        raise _DuplicateKey(f"key {dup!r} appears twice in one JSON object{where}; give each key once")
    return doc


def check_format(doc: Any, expected_format: str, where: str) -> None:
    """Raise FormatError unless `doc` is an object whose `format` equals `expected_format`."""
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: expected a JSON object with \"format\": \"{expected_format}\"")
    fmt = doc.get("format")
    if fmt == expected_format:
        return
    family = expected_format.rsplit("/", 1)[0]
    if fmt is None:
        raise FormatError(f"{where}: missing \"format\" key; this file should say \"format\": \"{expected_format}\"")
    if isinstance(fmt, str) and fmt.rsplit("/", 1)[0] == family:
        raise FormatError(
            f"{where}: unknown version {fmt!r}; this devplace reads {expected_format!r} (upgrade devplace "
            "or convert the file)"
        )
    raise FormatError(f"{where}: \"format\" is {fmt!r}, expected {expected_format!r}")


def dump_number(x: float) -> int | float:
    """Write integral values as JSON integers so that byte counts stay readable and exact."""
    if math.isfinite(x) and x == int(x) and abs(x) < 2**63:
        return int(x)
    return x


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    """Write `doc` as indented JSON with a trailing newline (stable bytes for equal input)."""
    Path(path).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
