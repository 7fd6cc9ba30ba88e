"""Op signatures: the `sig` of a captured node (docs/capture-format.md), enough to run the op again.

`encode_signature(func, args, kwargs)` turns one ATen call into JSON::

    {"target": "aten.mm.default",
     "args": [{"tensor": [64, 128], "dtype": "float32", "stride": [128, 1]}, ...],
     "kwargs": {...}}

- a tensor (real, fake or meta) becomes `{"tensor": shape, "dtype": name, "stride": strides}`;
- a list or tuple becomes a JSON list of its encoded items (so a list of tensors is a list of those);
- None, bool, int, str and finite floats are kept as they are;
- any other Python value becomes `{"py": repr(value)}` (`torch.float16`, `torch.contiguous_format`,
  `device(type='cuda', index=0)`, `inf`, ...).

`signature_key(sig)` is the canonical JSON (sorted keys, no spaces) that keys a cost table.

`decode_signature(sig, device)` rebuilds `(callable, args, kwargs)` with real tensors on `device`:

- every tensor is a fresh buffer of exactly the storage its shape and stride need, viewed with
  `as_strided`, so strides (including 0-strides of expanded tensors) are reproduced;
- floating and complex tensors hold seeded uniform random values in [0.5, 1.5): positive and away from 0,
  so log, sqrt, rsqrt, reciprocal and division give finite results, and no denormals slow the CPU down;
- integer and bool tensors are zeros, which is a valid index for every index argument of non-empty size;
  for the index arguments of common ops whose bound is known from the other arguments (embedding,
  embedding_dense_backward, index_select, gather, scatter*, index, index_put, nll_loss*), indices are instead
  seeded random in [0, bound), so gathers and scatters touch realistic, non-colliding memory;
- devices named in the signature (`{"py": "device(type='meta')"}`) are replaced by `device`, so an op
  captured on meta or fake tensors runs on the profiling device;
- dtypes, layouts and memory formats are looked up on `torch`; numbers in `{"py": ...}` (inf, nan, complex)
  are read with `ast.literal_eval`. Anything else cannot be rebuilt and raises `SignatureError`.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from devplace.errors import DevplaceError
from devplace.hardware.cost import signature_key

__all__ = ["SignatureError", "decode_signature", "encode_signature", "signature_key", "target_name"]


class SignatureError(DevplaceError):
    """A signature cannot be encoded or rebuilt (unknown op, Python value that cannot be recreated)."""


def target_name(func: Any) -> str:
    """`aten.mm.default` for an OpOverload, `aten.mm` for an OpOverloadPacket, else the str of `func`."""
    if isinstance(func, torch._ops.OpOverload):
        return f"{func.namespace}.{func._opname}.{func._overloadname}"
    if isinstance(func, torch._ops.OpOverloadPacket):
        return f"{func._qualified_op_name.replace('::', '.')}"
    return str(func)


def encode_signature(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON signature of the call `func(*args, **kwargs)` (see the module docstring)."""
    return {"target": target_name(func), "args": [_encode(a) for a in args],
            "kwargs": {str(k): _encode(v) for k, v in (kwargs or {}).items()}}


def _encode(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return {"tensor": [_int(s) for s in x.shape], "dtype": _dtype_name(x.dtype),
                "stride": [_int(s) for s in x.stride()]}
    if isinstance(x, list | tuple):  # torch.Size is a tuple
        return [_encode(i) for i in x]
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else {"py": repr(float(x))}
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        try:  # a symbol with a known value (backed by a hint) is that value
            return _encode({torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(x)](x))
        except Exception:
            return {"py": repr(x)}
    return {"py": repr(x)}


def _int(s: Any) -> Any:
    try:
        return int(s)
    except Exception:  # an unbacked symbolic size
        return {"py": repr(s)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------- decoding
def resolve_target(target: str) -> Callable[..., Any]:
    """`torch.ops.<ns>.<op>.<overload>` (or the packet when no overload is given)."""
    parts = target.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise SignatureError(f"signature target {target!r} is not of the form namespace.op[.overload]")
    try:
        obj: Any = getattr(getattr(torch.ops, parts[0]), parts[1])
        if len(parts) == 3:
            obj = getattr(obj, parts[2])
    except (AttributeError, RuntimeError) as exc:
        raise SignatureError(f"signature target {target!r} is not an operator of this torch "
                             f"({torch.__version__}): {exc}") from None
    return obj  # type: ignore[no-any-return]


_DEVICE_RE = re.compile(r"^device\(type='[\w:]+'(, index=\d+)?\)$")


def _decode_py(text: str, device: torch.device) -> Any:
    if _DEVICE_RE.match(text):
        return device
    if text.startswith("torch."):
        val = getattr(torch, text[len("torch."):], None)
        if isinstance(val, torch.dtype | torch.layout | torch.memory_format):
            return val
    if text in ("inf", "-inf", "nan"):
        return float(text)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise SignatureError(f"cannot rebuild the Python value {text!r} of a signature") from None


def _dtype(name: Any) -> torch.dtype:
    val = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(val, torch.dtype):
        raise SignatureError(f"unknown tensor dtype {name!r} in a signature")
    return val


def _make_tensor(spec: Mapping[str, Any], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    shape, stride = spec.get("tensor"), spec.get("stride")
    ok = (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
          and all(isinstance(s, int) and not isinstance(s, bool) for s in [*shape, *stride]))
    if not ok:
        raise SignatureError(f"tensor {spec!r}: \"tensor\" and \"stride\" must be integer lists of one length")
    dtype = _dtype(spec.get("dtype"))
    numel = 0 if any(s == 0 for s in shape) else 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride, strict=True))
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.rand(numel, generator=gen, device=device, dtype=torch.float32).add_(0.5)
        base = base.to(dtype)
    else:
        base = torch.zeros(numel, dtype=dtype, device=device)
    return base.as_strided(shape, stride)


def _decode(x: Any, device: torch.device, gen: torch.Generator) -> Any:
    if isinstance(x, list):
        return [_decode(i, device, gen) for i in x]
    if isinstance(x, Mapping):
        if "tensor" in x:
            return _make_tensor(x, device, gen)
        if set(x) == {"py"} and isinstance(x["py"], str):
            return _decode_py(x["py"], device)
        raise SignatureError(f"signature value {x!r} is neither a tensor nor {{\"py\": ...}}")
    return x


def decode_signature(sig: Mapping[str, Any], device: str | torch.device = "cpu", *,
                     seed: int = 0) -> tuple[Callable[..., Any], list[Any], dict[str, Any]]:
    """Rebuild `(op, args, kwargs)` from a signature, with real tensors on `device` (module docstring).

    The same signature, device and seed give the same tensor values. Raises SignatureError when the op is
    unknown or an argument cannot be rebuilt.
    """
    if not isinstance(sig, Mapping) or not isinstance(sig.get("target"), str):
        raise SignatureError(f"a signature is an object with a string \"target\", got {sig!r}")
    raw_args, raw_kwargs = sig.get("args", []), sig.get("kwargs", {})
    if not isinstance(raw_args, list) or not isinstance(raw_kwargs, Mapping):
        raise SignatureError(f"signature of {sig['target']}: \"args\" must be a list and \"kwargs\" an object")
    func = resolve_target(sig["target"])
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    args = [_decode(a, dev, gen) for a in raw_args]
    kwargs = {str(k): _decode(v, dev, gen) for k, v in raw_kwargs.items()}
    _valid_indices(sig["target"], args, kwargs, gen)
    return func, args, kwargs


# ---------------------------------------------------------------------- index arguments with a known bound
def _arg(args: list[Any], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if i < len(args) else kwargs.get(name)


def _fill_index(t: Any, bound: Any, gen: torch.Generator) -> None:
    """Fill an integer tensor with random values in [0, bound) (a no-op for anything else)."""
    if (not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex
            or t.dtype == torch.bool or not isinstance(bound, int) or bound <= 0 or t.numel() == 0):
        return
    base = t if t.is_contiguous() else None
    vals = torch.randint(0, bound, (t.numel(),), generator=gen, device=t.device, dtype=torch.int64).to(t.dtype)
    if base is not None:
        base.copy_(vals.view(t.shape))
    else:  # an overlapping or strided view: write its storage (a value in range stays in range)
        storage = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
        n = storage.numel()
        storage.copy_(torch.randint(0, bound, (n,), generator=gen, device=t.device, dtype=torch.int64).to(t.dtype))


def _dim_size(t: Any, dim: Any) -> int | None:
    if not isinstance(t, torch.Tensor) or not isinstance(dim, int) or t.dim() == 0:
        return None
    return int(t.shape[dim]) if -t.dim() <= dim < t.dim() else None


def _class_dim(t: Any) -> int | None:  # nll_loss: classes are dim 0 of a 1-d input, dim 1 otherwise
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    return int(t.shape[0] if t.dim() == 1 else t.shape[1])


def _valid_indices(target: str, args: list[Any], kwargs: dict[str, Any], gen: torch.Generator) -> None:
    parts = target.split(".")
    name = parts[1] if len(parts) > 1 else target
    name = name.rstrip("_") if not name.startswith("_") else "_" + name[1:].rstrip("_")
    a = lambda i, n: _arg(args, kwargs, i, n)  # noqa: E731
    if name == "embedding":
        w = a(0, "weight")
        _fill_index(a(1, "indices"), int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() else None, gen)
    elif name in ("embedding_dense_backward", "embedding_backward"):
        _fill_index(a(1, "indices"), a(2, "num_weights"), gen)
    elif name in ("index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index_add",
                  "index_copy", "index_fill"):
        _fill_index(a(2, "index"), _dim_size(a(0, "self"), a(1, "dim")), gen)
    elif name in ("index", "_unsafe_index", "index_put", "_unsafe_index_put", "_index_put_impl"):
        self_, indices = a(0, "self"), a(1, "indices")
        if isinstance(self_, torch.Tensor) and isinstance(indices, list):
            for d, idx in enumerate(indices):
                if d < self_.dim():
                    _fill_index(idx, int(self_.shape[d]), gen)
    elif name in ("nll_loss", "nll_loss_forward", "nll_loss2d_forward", "nll_loss_nd"):
        _fill_index(a(1, "target"), _class_dim(a(0, "self")), gen)
    elif name in ("nll_loss_backward", "nll_loss2d_backward"):
        _fill_index(a(2, "target"), _class_dim(a(1, "self")), gen)
