"""Reading and writing devplace's versioned JSON documents (shared by every `format`). Files are read and
written through `devplace.files` (regular files only, the input-size limit, atomic writes that never replace an
input)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devplace.errors import FormatError
from devplace.files import json_kind, json_text, read_limited, write_output


def read_json(path: str | Path, expected_format: str, *, max_bytes: int | None = None,
              older: Sequence[str] = ()) -> dict[str, Any]:
    """Parse `path` and check that its `format` key is `expected_format` (same family, same version), or one of
    the `older` versions of it that this devplace still reads.

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
    check_format(doc, expected_format, str(path), older)
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


def check_format(doc: Any, expected_format: str, where: str, older: Sequence[str] = ()) -> None:
    """Raise FormatError unless `doc` is an object whose `format` equals `expected_format` or one of its `older`
    versions that are still read."""
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: expected a JSON object with \"format\": \"{expected_format}\"")
    fmt = doc.get("format")
    if fmt == expected_format or fmt in older:
        return
    family = expected_format.rsplit("/", 1)[0]
    if fmt is None:
        raise FormatError(f"{where}: missing \"format\" key; this file should say \"format\": \"{expected_format}\"")
    if isinstance(fmt, str) and fmt.rsplit("/", 1)[0] == family:
        raise FormatError(f"{where}: unknown version {fmt!r}; this devplace reads {_versions(expected_format, older)} "
                          "(upgrade devplace or convert the file)")
    raise FormatError(f"{where}: \"format\" is {fmt!r}, expected {_versions(expected_format, older)}")


def _versions(expected_format: str, older: Sequence[str]) -> str:
    """The versions a reader takes, for messages: 'devplace.x/2' or 'devplace.x/2' (or older 'devplace.x/1')."""
    return repr(expected_format) + (f" (or older {', '.join(map(repr, older))})" if older else "")


def dump_number(x: float) -> int | float:
    """Write integral values as JSON integers so that byte counts stay readable and exact."""
    if math.isfinite(x) and x == int(x) and abs(x) < 2**63:
        return int(x)
    return x


def write_json(path: str | Path, doc: dict[str, Any], what: str = "output") -> None:
    """Write `doc` as indented JSON with a trailing newline (stable bytes for equal input), atomically, replacing
    only a devplace file of the same format family (`devplace.files.output_file`; `what` names the output in
    messages)."""
    fmt = doc.get("format")
    kind = json_kind(fmt.rsplit("/", 1)[0]) if isinstance(fmt, str) else None
    write_output(path, json_text(doc, indent=1) + "\n", what, kind)
