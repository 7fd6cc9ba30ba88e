"""Custom models named `package.module:factory`, usable wherever a zoo model name is.

The factory is a function (any importable callable) that returns `(module, example_inputs)` or
`(module, example_inputs, loss_fn)`, as a zoo factory does (`devplace.zoo.models`): `module(*example_inputs)`
is the step's forward and `loss_fn(output)` its loss (default: `capture`'s, the output's `.loss` or its
sum). When `--batch` / `--seq-len` are given they are passed as keyword arguments `batch=` / `seq_len=`,
so a factory that accepts them can size its inputs. The module is built for real, on the CPU, under a
seeded random generator (the caller's global RNG is untouched).

`build_named_model`, `capture_named_model` and `named_prepared` take a zoo name or a custom one, so a
command that accepts one accepts both.

A custom name is code: importing it runs the module's top-level code. A name typed by the user (`--model`) is
imported; a name read from a data file (a plan, a pipeline export) only when the user allows it
(`check_trusted`), so that a file passed around cannot run code.

Whatever the user's code raises while importing or building (any BaseException: SystemExit and
KeyboardInterrupt included) becomes one CustomModelError, "custom model 'x:f' failed: <type>: <message>"; what
it raises later, in its forward or loss while a step is captured or run (`model_code`), becomes one too.

The modules a custom name imports are inputs of the command (`devplace.files.protect_modules`): no output
replaces them, --force or not.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from devplace.capture.pipeline import (
    ModelRef,
    Prepared,
    capture_zoo_model,
    first_samples,
    precision_suffix,
    prepare,
)
from devplace.capture.torch_capture import capture
from devplace.errors import DevplaceError
from devplace.files import protect_modules
from devplace.graph.batch import MICROBATCHES_META_KEY, divisors_text, graph_batch
from devplace.graph.coarsen import Coarsening
from devplace.graph.compgraph import CompGraph

__all__ = ["CustomModelError", "build_custom_model", "build_named_model", "capture_named_model", "check_trusted",
           "is_custom", "load_factory", "model_code", "named_prepared"]

# how a factory must look, for the messages about one that does not
FACTORY_SHAPE = ("a factory is a function returning (module, example_inputs) or (module, example_inputs, loss_fn), "
                 "module(*example_inputs) being the forward")

Built = tuple[nn.Module, tuple[Any, ...], Callable[..., torch.Tensor] | None]

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class CustomModelError(DevplaceError):
    """A `package.module:factory` name that cannot be imported, called, or returns the wrong thing."""


def is_custom(name: str) -> bool:
    """True for a `package.module:factory` name (zoo names have no colon)."""
    return ":" in name


def check_trusted(spec: str, trust: bool | str, where: str) -> None:
    """Refuse to import custom model `spec` that a data file (`where`, e.g. "plan.json") names, unless the user
    allows it: `trust` True (`--trust-model`) or equal to `spec` (the user repeated it as `--model`)."""
    if trust is True or trust == spec:
        return
    if isinstance(trust, str) and trust:
        raise CustomModelError(f"--model {trust} differs from the custom model {where} names ({spec!r}); give "
                               f"--model {spec} to run it, or drop --model")
    raise CustomModelError(f"{where} asks to import and run custom model {spec!r} (Python code on this machine); "
                           f"a data file runs no code unless you allow it: repeat it as --model {spec}, or pass "
                           "--trust-model")


def _what(exc: BaseException) -> str:
    """"Type: message" of what the user's code raised (the type alone when it says nothing, as KeyboardInterrupt)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _failed(spec: str, exc: BaseException) -> CustomModelError:
    return CustomModelError(f"custom model {spec!r} failed: {_what(exc)}")


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable that `package.module:factory` names (`factory` may be a dotted attribute path)."""
    mod_name, _, attr = spec.partition(":")
    if not _DOTTED.fullmatch(mod_name) or not _DOTTED.fullmatch(attr):
        raise CustomModelError(f"custom model {spec!r} must be written package.module:factory (dotted Python names, "
                               "no relative import), e.g. mymodels.towers:build")
    before = set(sys.modules)
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and mod_name.startswith(exc.name):  # the named module itself, not one it imports
            raise CustomModelError(f"custom model {spec!r}: cannot import module {mod_name!r} ({exc}); is it on "
                                   "PYTHONPATH (or installed), and is the name spelled right?") from exc
        raise _failed(spec, exc) from exc
    except BaseException as exc:  # the module's own code: a syntax error, an exception, even sys.exit() at import
        raise _failed(spec, exc) from exc
    finally:  # what it imported (its package and the modules it loaded) is code the command read
        parents = [mod_name.rsplit(".", i)[0] for i in range(mod_name.count(".") + 1)]
        protect_modules(sorted(set(sys.modules) - before | set(parents)))
    for part in attr.split("."):
        if not hasattr(obj, part):
            have = sorted(n for n in dir(obj) if not n.startswith("_"))[:8]
            raise CustomModelError(f"custom model {spec!r}: {mod_name!r} has no attribute {attr!r} (names there "
                                   f"include {', '.join(have) or 'nothing public'})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CustomModelError(f"custom model {spec!r}: {attr!r} is a {type(obj).__name__}, not a function that "
                               "returns (module, example_inputs[, loss_fn])")
    return obj  # type: ignore[no-any-return]


# where Python, the installed packages and devplace itself live: a frame elsewhere is the user's model code
_LIBRARY_ROOTS = tuple(sorted({str(Path(p).resolve()) for p in (
    *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")), sys.prefix, sys.base_prefix,
    Path(__file__).resolve().parents[1])}))


def _user_frame(exc: BaseException) -> str | None:
    """"file:line" of the innermost frame of `exc`'s traceback in the user's code (outside `_LIBRARY_ROOTS`),
    or None when it passed through none (an error of devplace or a library, or a signal)."""
    where = None
    tb = exc.__traceback__
    while tb is not None:
        file = tb.tb_frame.f_code.co_filename
        if not file.startswith("<") and not str(Path(file).resolve()).startswith(_LIBRARY_ROOTS):
            where = f"{file}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


@contextlib.contextmanager
def model_code(stage: str) -> Iterator[None]:
    """Run a model's forward and loss (during `stage`, e.g. "the capture"): what the user's own code raises -- an
    exception whose traceback passes through a file outside Python, the installed packages and devplace, such
    as SystemExit from sys.exit() or KeyboardInterrupt raised in a forward -- becomes one CustomModelError
    naming that line; devplace's own errors and the libraries' pass unchanged."""
    try:
        yield
    except DevplaceError:
        raise
    except BaseException as exc:
        where = _user_frame(exc)
        if where is None:
            raise
        raise CustomModelError(f"the model's code failed during {stage} at {where}: {_what(exc)}"[:1000]) from exc


def _sizes(factory: Callable[..., Any], spec: str, batch: int | None, seq_len: int | None) -> dict[str, int]:
    given = {k: v for k, v in (("batch", batch), ("seq_len", seq_len)) if v is not None}
    if not given:
        return {}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: pass them and let it complain
        return given
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for k in given:
        if k not in params and not takes_any:
            flag = "--batch" if k == "batch" else "--seq-len"
            raise CustomModelError(f"custom model {spec!r}: the factory takes no {k!r} argument; drop {flag} or "
                                   f"give the factory a {k}= parameter")
    return given


def build_custom_model(spec: str, batch: int | None = None, seq_len: int | None = None, *, seed: int = 0) -> Built:
    """(module, example_inputs as a tuple, loss_fn or None) from the factory `spec` names (module docstring)."""
    factory = load_factory(spec)
    kwargs = _sizes(factory, spec, batch, seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            out = factory(**kwargs)
        except BaseException as exc:  # the user's code (SystemExit too): one line that says whose error it is
            raise _failed(spec, exc) from exc
    if not isinstance(out, tuple | list) or len(out) not in (2, 3):
        raise CustomModelError(f"custom model {spec!r}: the factory must return (module, example_inputs) or "
                               f"(module, example_inputs, loss_fn), got {type(out).__name__}"
                               + (f" of length {len(out)}" if isinstance(out, tuple | list) else ""))
    module, inputs = out[0], out[1]
    loss_fn = out[2] if len(out) == 3 else None
    if not isinstance(module, nn.Module):
        raise CustomModelError(f"custom model {spec!r}: the first item the factory returns must be a "
                               f"torch.nn.Module, got {type(module).__name__}; {FACTORY_SHAPE}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    if not isinstance(inputs, tuple) or not inputs:
        raise CustomModelError(f"custom model {spec!r}: example_inputs must be a tensor or a non-empty tuple of "
                               f"the module's positional arguments, got {type(out[1]).__name__}; {FACTORY_SHAPE}")
    if loss_fn is not None and not callable(loss_fn):
        raise CustomModelError(f"custom model {spec!r}: loss_fn must be callable (output -> scalar loss) or None, "
                               f"got {type(loss_fn).__name__}")
    module.train()
    return module, inputs, loss_fn


def build_named_model(name: str, batch: int | None = None, seq_len: int | None = None, *, seed: int = 0) -> Built:
    """A zoo model or a custom `package.module:factory` one: (module, example_inputs, loss_fn)."""
    if is_custom(name):
        return build_custom_model(name, batch, seq_len, seed=seed)
    from devplace.zoo.models import build_model

    return build_model(name, batch, seq_len, seed=seed)


def capture_named_model(name: str, *, batch: int | None = None, seq_len: int | None = None,
                        optimizer: str = "adam", seed: int = 0, dtype: str | None = None,
                        amp: bool = False) -> CompGraph:
    """The captured training step of a zoo model or a custom one (see `capture_zoo_model`), in precision
    `dtype` / `amp` (as `devplace.capture.capture`)."""
    if not is_custom(name):
        return capture_zoo_model(name, batch=batch, seq_len=seq_len, optimizer=optimizer, dtype=dtype, amp=amp)
    module, inputs, loss_fn = build_custom_model(name, batch, seq_len, seed=seed)
    label = name.rpartition(":")[2] + (f"-b{batch}" if batch is not None else "") + (
        f"-s{seq_len}" if seq_len is not None else "") + precision_suffix(dtype, amp)
    with model_code("the capture"):
        return capture(module, inputs, loss_fn=loss_fn, optimizer=optimizer, name=label, dtype=dtype, amp=amp)


def named_prepared(name: str, *, batch: int | None = None, seq_len: int | None = None, optimizer: str = "adam",
                   seed: int = 0, dtype: str | None = None, amp: bool = False, **options: Any) -> Prepared:
    """`capture_named_model` then `prepare` (device, costs, max_nodes as `capture.pipeline.prepare`); the result
    keeps a `ModelRef`, so `microbatch_prepared` can capture one micro-batch of the same step."""
    graph = capture_named_model(name, batch=batch, seq_len=seq_len, optimizer=optimizer, seed=seed, dtype=dtype,
                                amp=amp)
    return prepare_named(graph, name, seq_len=seq_len, optimizer=optimizer, seed=seed, dtype=dtype, amp=amp,
                         **options)


def prepare_named(graph: CompGraph, name: str, *, seq_len: int | None = None, optimizer: str = "adam", seed: int = 0,
                  dtype: str | None = None, amp: bool = False, **options: Any) -> Prepared:
    """`prepare` the step of model `name` that `capture_named_model` captured with these settings (`graph`, e.g.
    read back from a study's cache), keeping the `ModelRef` that captures its micro-batches: the same Prepared as
    `named_prepared`."""
    ref = ModelRef(name, seq_len, optimizer, seed, dtype, amp, tuple(sorted(options.items())))
    return prepare(graph, model=ref, **options)


def microbatch_prepared(prepared: Prepared, microbatches: int) -> Prepared:
    """One of `microbatches` equal micro-batches of the step `prepared` holds: the same model captured again at
    batch / M and prepared alike, its graphs marked as one micro-batch of M (`graph_microbatches`), so that a
    schedule runs it M times and every op is costed at the micro-batch's size (not the whole batch's / M). M = 1
    gives `prepared` itself. DevplaceError when `prepared` has no model to capture or records no batch, or when
    M does not divide the batch."""
    if microbatches == 1:
        return prepared
    return prepare_microbatch(prepared, microbatch_capture(prepared, microbatches))


def microbatch_capture(prepared: Prepared, microbatches: int) -> CompGraph:
    """The capture `microbatch_prepared` costs (M > 1): the model of `prepared` captured at batch / M, marked as
    one of M micro-batches; what a caller may keep and read back (a graph file) to prepare again without
    capturing (`prepare_microbatch`). DevplaceError as `microbatch_prepared`."""
    ref, batch = prepared.model, graph_batch(prepared.full)
    if ref is None or batch is None:
        raise DevplaceError(f"graph {prepared.full.name!r} was not captured from a model with a batch here, so its "
                            "micro-batches cannot be captured at their own size; place it with --model")
    if batch % microbatches:
        raise DevplaceError(f"{microbatches} micro-batches do not split the batch of {batch} into equal "
                            f"micro-batches; with batch {batch} use one of {divisors_text(batch)}, or a batch that "
                            f"{microbatches} divides")
    if is_custom(ref.name) and not _takes_batch(ref.name):
        graph = _capture_first_samples(ref, batch, batch // microbatches)
    else:
        graph = capture_named_model(ref.name, batch=batch // microbatches, seq_len=ref.seq_len,
                                    optimizer=ref.optimizer, seed=ref.seed, dtype=ref.dtype, amp=ref.amp)
    graph.meta[MICROBATCHES_META_KEY] = microbatches  # a fresh capture's own dict: mark it before it is costed
    return graph


def prepare_microbatch(prepared: Prepared, graph: CompGraph) -> Prepared:
    """`graph`, a micro-batch of `prepared`'s model (`microbatch_capture`), prepared as `prepared` was (its
    model's device, cost table and coarsening options)."""
    assert prepared.model is not None
    return prepare(graph, model=prepared.model, **dict(prepared.model.options))


def _takes_batch(spec: str) -> bool:
    """Whether the factory `spec` names sizes its inputs from a `batch=` keyword (a builtin: assume it does)."""
    try:
        params = inspect.signature(load_factory(spec)).parameters
    except (TypeError, ValueError):
        return True
    return "batch" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _capture_first_samples(ref: ModelRef, batch: int, size: int) -> CompGraph:
    """The step of custom model `ref`, whose factory sizes its own inputs (`batch` samples), captured on the first
    `size` samples of every input of that batch: a micro-batch, as `devplace.plan` cuts a module's inputs."""
    module, inputs, loss_fn = build_custom_model(ref.name, None, ref.seq_len, seed=ref.seed)
    label = ref.name.rpartition(":")[2] + f"-b{size}" + (f"-s{ref.seq_len}" if ref.seq_len is not None else "") + (
        precision_suffix(ref.dtype, ref.amp))
    with model_code("the capture"):
        return capture(module, first_samples(inputs, batch, size), loss_fn=loss_fn, optimizer=ref.optimizer,
                       name=label, dtype=ref.dtype, amp=ref.amp)


def microbatch_graphs(prepared: Prepared) -> Callable[[int], tuple[CompGraph, Coarsening]] | None:
    """Where the search gets a micro-batch count's graph for a captured model (`placers.search.MicrobatchGraph`):
    M -> the full graph and coarsening of `microbatch_prepared(prepared, M)`, captured at batch / M; None when
    `prepared` has no model to capture again or records no batch (a graph file: a pipeline then costs a
    micro-batch as the whole batch's / M)."""
    if prepared.model is None or graph_batch(prepared.full) is None:
        return None

    def graph_of(microbatches: int) -> tuple[CompGraph, Coarsening]:
        micro = microbatch_prepared(prepared, microbatches)
        return micro.full, micro.coarsening
    return graph_of
