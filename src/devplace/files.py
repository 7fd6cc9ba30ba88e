"""The files every command reads and writes: the one reader (regular files only, at most the input limit) and
the one writer (atomic, never over an input, never through a symbolic link, never over a file that is not
devplace's own output of that kind unless forced).

Reading: `read_limited` refuses what is not a regular file (a FIFO would block forever, a device such as
/dev/zero never ends) and stops after the input limit (default 256 MiB, far above any real graph, cluster,
placement, plan or study file). Raise the limit with DEVPLACE_MAX_INPUT_BYTES, `devplace --max-input-bytes N`
(`set_max_input_bytes`) or the `max_bytes` keyword.

Writing: `check_output` refuses, before any work, an output that cannot or must not be written; `output_file`
(and `write_output`, `append_output` over it) writes a temporary file in the same folder and renames it over
the target, so a crash or a full disk leaves the old file (or none) and never half a file. While a command runs
(`begin_command`), every file it read is remembered and no output may resolve to one of them; `protect` adds
files that are opened otherwise (the study database). `set_force(True)` (`--force`) allows replacing a symbolic
link itself (never its target) and an existing file that is not devplace's output of that kind.

This module imports only `devplace.errors`, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from devplace.errors import DevplaceError, FormatError

__all__ = [
    "ANY_JSON",
    "CHECKPOINT",
    "CSV_CURVE",
    "DEFAULT_MAX_INPUT_BYTES",
    "JSON_LINES_RUN",
    "MAX_INPUT_BYTES_LIMIT",
    "MAX_INPUT_ENV",
    "PNG",
    "TRACE",
    "Kind",
    "OutputPathError",
    "append_output",
    "begin_command",
    "check_output",
    "end_command",
    "env_limit",
    "json_kind",
    "json_safe",
    "json_text",
    "max_input_bytes",
    "output_file",
    "output_folder",
    "parse_json",
    "protect",
    "protect_modules",
    "read_limited",
    "save_png",
    "set_force",
    "set_max_input_bytes",
    "write_output",
]

MAX_INPUT_ENV = "DEVPLACE_MAX_INPUT_BYTES"
DEFAULT_MAX_INPUT_BYTES = 256 * 2**20
# the largest input limit accepted: 1 TiB is far above any file devplace reads, and keeps `limit + 1` a size
# that `read()` takes (2**63 - 1 overflows it)
MAX_INPUT_BYTES_LIMIT = 2**40
# how much of an existing output is read to tell whether devplace wrote it
_HEAD_BYTES = 4096


class OutputPathError(DevplaceError):
    """An output file that cannot or must not be written: a folder, in a missing folder, not writable, one of
    the command's inputs, a symbolic link, or a file devplace did not write."""


# ------------------------------------------------------------------------------------------------- limits


def env_limit(value: int | None, *, env: str, default: int, name: str, unit: str, example: int,
              error: type[Exception] = FormatError, maximum: int | None = None) -> int:
    """A positive whole-number limit: `value` (the keyword `name`) when given, else the environment variable
    `env`, else `default`; anything else (or above `maximum`) raises `error` saying how to set it (`example` is
    shown)."""
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
    if maximum is not None and value > maximum:
        raise error(f"{where} must be at most {maximum:,} {unit}, got {value:,}")
    return value


def max_input_bytes(max_bytes: int | None = None) -> int:
    """The input-size limit: `max_bytes` when given, else DEVPLACE_MAX_INPUT_BYTES, else 256 MiB."""
    return env_limit(max_bytes, env=MAX_INPUT_ENV, default=DEFAULT_MAX_INPUT_BYTES, name="max_bytes", unit="bytes",
                     example=4 * DEFAULT_MAX_INPUT_BYTES, maximum=MAX_INPUT_BYTES_LIMIT)


def set_max_input_bytes(max_bytes: int) -> int:
    """Raise (or lower) the input-size limit of this process and of every process it starts (a study's workers
    read graph and cluster files too): the limit is kept in DEVPLACE_MAX_INPUT_BYTES, which they inherit.
    Returns the limit; a value that is not a whole number from 1 to 1 TiB raises FormatError and changes
    nothing."""
    limit = env_limit(max_bytes, env=MAX_INPUT_ENV, default=DEFAULT_MAX_INPUT_BYTES, name="--max-input-bytes",
                      unit="bytes", example=4 * DEFAULT_MAX_INPUT_BYTES, maximum=MAX_INPUT_BYTES_LIMIT)
    os.environ[MAX_INPUT_ENV] = str(limit)
    return limit


# ------------------------------------------------------------------------------------ the command's state


@dataclass
class _Command:
    inputs: set[Path]  # resolved paths of the files this command read (or protects)
    force: bool = False


_command: _Command | None = None  # None outside a command: the Python API tracks nothing


def begin_command() -> None:
    """Start remembering the files this process reads, as the inputs no output may replace (the CLI calls it
    once per command; anything remembered before is dropped, and --force is off again)."""
    global _command
    _command = _Command(set())


def end_command() -> None:
    """Stop remembering inputs (the command is over); the Python API tracks nothing."""
    global _command
    _command = None


def set_force(force: bool) -> None:
    """`--force`: allow replacing a symbolic link (the link, not its target) and an existing file that is not
    devplace's output of that kind. Outputs that are inputs stay refused."""
    if _command is None:
        begin_command()
    assert _command is not None
    _command.force = force


def protect(path: str | Path) -> None:
    """Remember `path` as an input of this command (no output may resolve to it): for files opened by other
    means than `read_limited`, such as the study database."""
    if _command is not None:
        _command.inputs.add(_resolved(Path(path)))


def protect_modules(names: Iterable[str]) -> None:
    """Remember the source files of the imported modules `names` (those of `sys.modules` that have a file) as
    inputs of this command: code it imported (a custom model, `--model pkg.mod:factory`) is one of its inputs,
    which no output may replace, --force or not."""
    if _command is None:
        return
    for name in names:
        module = sys.modules.get(name)
        for attr in ("__file__", "__cached__"):
            file = getattr(module, attr, None)
            if isinstance(file, str):
                protect(file)


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: compare by the name as given
        return path.absolute()


# ------------------------------------------------------------------------------------------------ reading


def read_limited(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of `path`, which must be a regular file no longer than the input limit.

    A FIFO, device or socket is refused without reading from it (opened non-blocking, so a FIFO without a
    writer cannot hang); at most limit + 1 bytes are read. Raises FormatError for a missing, unreadable, not
    regular or too large file. The file is remembered as an input of the running command.
    """
    path = Path(path)
    limit = max_input_bytes(max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise FormatError(f"{path}: is {what}; give a regular file")
    with os.fdopen(fd, "rb") as fh:
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise FormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise FormatError(f"{path}: longer than the input limit of {limit:,} bytes; check that it is the right "
                          f"file, or raise the limit with `devplace --max-input-bytes N` or {MAX_INPUT_ENV}=N (bytes)")
    protect(path)
    return data


# ------------------------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class Kind:
    """A kind of output devplace writes: `name` for messages, `test(head)` tells from a file's first 4 KiB
    whether devplace wrote it (only such a file is replaced without --force)."""

    name: str
    test: Callable[[bytes], bool]


def json_kind(fmt: str) -> Kind:
    """Devplace's JSON documents of `format` family `fmt` (e.g. "devplace.placement"), any version."""
    pattern = re.compile(rb'"format":\s*"' + re.escape(fmt.encode()) + rb"/")
    return Kind(f"{fmt} JSON", lambda head: pattern.search(head) is not None)


ANY_JSON = Kind("devplace JSON", lambda head: re.search(rb'"format":\s*"devplace\.', head) is not None)
TRACE = Kind("trace-event JSON", lambda head: head.startswith(b'{"traceEvents":['))
# devplace's PNGs carry Software=devplace (a tEXt chunk before the image data)
PNG = Kind("devplace PNG", lambda head: head.startswith(b"\x89PNG") and b"Software\x00devplace" in head)
CSV_CURVE = Kind("learning-curve CSV", lambda head: head.startswith(b"episode,"))
CHECKPOINT = Kind("policy checkpoint", lambda head: head.startswith(b"PK") and b"devplace.policy/" in head)
JSON_LINES_RUN = Kind("run record (JSON lines)", lambda head: b'"format": "devplace.run/' in head.split(b"\n")[0])
PNG_METADATA = {"Software": "devplace"}  # what devplace's `savefig` calls pass, for `PNG`


def _option(path: Path, what: str) -> str:
    return f"{what} {path}" if what.startswith("-") else f"{what} file {path}"


def check_output(path: str | Path, what: str, kind: Kind | None = None) -> Path:
    """Refuse, before any work, an output file (`what`: the option or a word, for the message) that cannot or
    must not be written: a folder (or a name ending in /), in a missing or read-only folder, a FIFO or device,
    one of the running command's inputs (symlinks followed), a symbolic link, or an existing file that `kind`
    does not recognise as devplace's (the last two unless --force). Nothing is created or changed. Returns the
    path."""
    path = Path(path)
    name = _option(path, what)
    try:
        _check_output(path, name, what, kind)
    except OSError as exc:  # a name longer than the file system allows (ENAMETOOLONG), a component not a folder
        raise OutputPathError(f"{name}: cannot be used as an output ({exc.strerror or exc}); give a shorter or "
                              "other file name") from None
    return path


def _check_output(path: Path, name: str, what: str, kind: Kind | None) -> None:
    force = _command is not None and _command.force
    if str(path).endswith(("/", os.sep)) or path.is_dir():
        raise OutputPathError(f"{name}: is a folder; give the name of a file (in it, or elsewhere)")
    target = _resolved(path)
    if _command is not None and target in _command.inputs:
        raise OutputPathError(f"{name}: is {'a link to ' if path.is_symlink() else ''}an input of this command "
                              f"({target}); writing it would destroy it, give another file name")
    parent = path.parent
    if not parent.is_dir():
        raise OutputPathError(f"{name}: folder {parent} does not exist; create it first (mkdir -p {parent})")
    if path.is_symlink():
        if not force:
            raise OutputPathError(f"{name}: is a symbolic link (to {os.readlink(path)}); devplace does not write "
                                  "through links: give the target's own name, or --force to replace the link")
    elif path.exists():
        if not path.is_file():
            raise OutputPathError(f"{name}: exists and is not a regular file (a FIFO or device); give a file name")
        if kind is not None and not force and not _is_kind(path, kind):
            raise OutputPathError(f"{name}: exists and is not a {kind.name} devplace wrote; give another name, or "
                                  "--force to replace it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{name}: folder {parent} is not writable; choose another folder")


def _is_kind(path: Path, kind: Kind) -> bool:
    try:
        with path.open("rb") as fh:
            return kind.test(fh.read(_HEAD_BYTES))
    except OSError:
        return False


def output_folder(out: str | Path, what: str) -> Path:
    """The folder an option (`what`) names for a command's output files, made if missing; OutputPathError when
    it is a file or cannot be made or written. The files in it are checked as they are written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{what} {out}: is a file, not a folder; give a folder for the output files")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"{what} {out}: cannot make the folder ({exc.strerror}); give another folder") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} {out}: the folder is not writable; give another folder")
    return out


@contextlib.contextmanager
def output_file(path: str | Path, what: str, kind: Kind | None = None, *, binary: bool = False,
                newline: str | None = None) -> Iterator[IO[Any]]:
    """Write an output atomically: yields a file object on a temporary file in the target's folder, renamed over
    `path` when the block ends without an error (and removed when it does not). `check_output` runs first;
    OS errors (a full disk, a folder removed meanwhile) raise OutputPathError and leave `path` as it was."""
    path = check_output(path, what, kind)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:100]}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as a plain open() would create it (mkstemp makes it private)
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": newline})
                       ) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())  # a full disk shows here, before the old file is replaced
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputPathError(f"{_option(path, what)}: cannot be written ({exc.strerror or exc}); "
                              "nothing was changed") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def parse_json(text: str, where: str, expected: str) -> Any:
    """`text` parsed as JSON, or a FormatError "`where`: not valid JSON (why); `expected`" for malformed text,
    nesting too deep for the parser (RecursionError) or an integer too long to convert (`expected` says what the
    file should hold)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        why = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
    except RecursionError:
        why = "arrays or objects nested too deeply"
    except ValueError as exc:  # an integer of more than 4300 digits
        why = str(exc).split(";")[0]
    raise FormatError(f"{where}: not valid JSON ({why}); {expected}")


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (NaN, +-inf) replaced by None: JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def json_text(doc: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """`doc` as strict JSON text, what every JSON devplace writes goes through: NaN and infinities become null
    (`json_safe`; Python's json would write the bare NaN and Infinity that other readers refuse)."""
    return json.dumps(json_safe(doc), indent=indent, sort_keys=sort_keys, allow_nan=False)


def write_output(path: str | Path, data: str | bytes, what: str, kind: Kind | None = None) -> None:
    """Write `data` (text as UTF-8) to `path` atomically (`output_file`)."""
    text = _encoded(data, path, what) if isinstance(data, str) else data
    with output_file(path, what, kind, binary=True) as fh:
        fh.write(text)


def append_output(path: str | Path, data: str, what: str, kind: Kind | None = None) -> None:
    """Append `data` to `path` (created if missing) atomically: the old content plus `data` are written to a
    temporary file and renamed over it, so an interrupted append leaves the file as it was."""
    path = check_output(path, what, kind)
    old = read_limited(path) if path.exists() else b""
    _inputs_drop(path)  # read here only to be kept: not an input of the command
    write_output(path, old + _encoded(data, path, what), what, kind)


def _encoded(text: str, path: str | Path, what: str) -> bytes:
    """`text` as UTF-8, refused (before anything is written) where it holds a lone surrogate, which no file can
    hold."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OutputPathError(f"{_option(Path(path), what)}: not written: the text holds {text[exc.start]!a}, a "
                              "lone surrogate that is not a character; fix the name that holds it") from None


def _inputs_drop(path: Path) -> None:
    if _command is not None:
        _command.inputs.discard(_resolved(path))


def save_png(fig: Any, path: str | Path, what: str, **savefig: Any) -> None:
    """Save a matplotlib figure as devplace's PNG (marked Software=devplace, no version in the bytes) atomically.
    matplotlib's warnings while drawing (e.g. a glyph a font lacks, which repeats a user's name with its raw
    control characters) are not shown: the figure is written either way."""
    with output_file(path, what, PNG, binary=True) as fh, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig.savefig(fh, format="png", metadata=PNG_METADATA, **savefig)
