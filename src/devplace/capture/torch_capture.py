"""Capture one training step of a PyTorch module as a `CompGraph` (docs/capture-format.md, docs/capture.md).

The step (forward, loss, `loss.backward()`, `optimizer.step()`) runs once on fake tensors
(`torch._subclasses.fake_tensor.FakeTensorMode`: shapes, dtypes and strides, no data, no memory), under a
`TorchDispatchMode` that sees every ATen op below autograd and records it as a node:

- tensor identity is storage identity: each storage has a current *value* (the node and output index that
  last wrote it); a view or alias op shares its input's storage and is folded (no node, no edge: consumers
  of the view read the base's value and an edge carries the base's bytes); an in-place op reads the old
  value and becomes the storage's new value;
- kind is the phase the op ran in; a backward op's colocation group is the forward op that created the
  autograd node being run (`torch._C._current_autograd_node()` and autograd sequence numbers); an optimizer
  op's group is the first forward consumer of the parameter it updates;
- the module path comes from forward pre/post hooks on every submodule;
- an op's compute dtype (node key `dtype`) is the dtype of its first floating-point input (else output):
  what the cost model reads to choose the device's peak FLOP/s for that precision.

`capture(dtype=..., amp=...)` chooses the training precision: the parameters, buffers and inputs cast to
`dtype`, or (with `amp`) the forward and loss run under `torch.autocast` to bf16/fp16 while the
parameters keep their dtype (docs/capture-format.md, "Precision").
"""

from __future__ import annotations

import bisect
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map_only

from devplace.capture.flops import op_flops
from devplace.capture.signature import encode_signature, target_name
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.graph.phases import ACCUMULATE_BYTES_KEY, ACCUMULATES_KEY, SCALE_BY
from devplace.graph.semantics import SEMANTICS_KEY, Semantics

__all__ = ["DTYPES", "CaptureError", "capture"]

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
OPTIMIZERS = ("adam", "sgd", "none")
_NO_SEQUENCE = 2**64 - 1  # the sequence number of AccumulateGrad nodes
# Ops that move no data of the step: device queries, and the lifting of a Python constant into a tensor.
_SKIP_OPS = {torch.ops.prim.device.default, torch.ops.aten.lift_fresh.default}
_SKIP_NAMESPACES = {"profiler"}
# An in-place op on an activation (ReLU(inplace=True), `x += y`) produces a new value of that tensor which
# later readers use: counting its bytes as the op's output keeps the tensor live in the simulator's memory
# model for as long as they need it (with 0, it would be freed when the op that allocated it has no consumer
# left). In-place writes to parameters, buffers and optimizer state always count 0 (they are in param_bytes).
INPLACE_REWRITE_ALLOCATES = True
_CIA = torch._C.DispatchKey.CompositeImplicitAutograd
_SDP_CHOICE = torch.ops.aten._fused_sdp_choice.default
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

OptimizerSpec = str | Callable[[list[torch.Tensor]], torch.optim.Optimizer]
# The training precisions `capture(dtype=...)` takes, by their short names.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_GROUPED_MM = torch.ops.aten._grouped_mm


class CaptureError(DevplaceError):
    """A model cannot be captured (data-dependent op, no trainable output, bad arguments)."""


# ------------------------------------------------------------------------------------------ helpers
def _key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views and in-place results share it)."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): the tensor is its own storage
        return id(t)


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: its elements; for a sparse tensor its stored values and indices (the gradient of
    `nn.Embedding(sparse=True)` holds the rows a batch touches, not the table: numel() is the dense size)."""
    if t.layout == torch.sparse_coo:
        return _nbytes(t._values()) + _nbytes(t._indices())
    if t.layout in _COMPRESSED:
        rows, cols = ((t.crow_indices(), t.col_indices()) if t.layout in (torch.sparse_csr, torch.sparse_bsr)
                      else (t.ccol_indices(), t.row_indices()))
        return _nbytes(t.values()) + _nbytes(rows) + _nbytes(cols)
    return int(t.numel()) * t.element_size()


def _read_bytes(t: torch.Tensor) -> int:
    """Bytes an op reads from a tensor: its elements, but at most its storage (a broadcast view reads less)."""
    try:
        return min(_nbytes(t), int(t.untyped_storage().nbytes()))
    except (RuntimeError, NotImplementedError):
        return _nbytes(t)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _compute_dtype(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> str:
    """The precision an op computes in: its first floating-point input's dtype (a matmul's operands, a cast's
    source), else its first floating-point output's (a factory such as `zeros`), else "" (integer ops)."""
    for group in (inputs, outputs):
        for t in group:
            if t.is_floating_point():
                return _dtype(t)
    return ""


def _run_op(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """Run `func` on the fake tensors. `aten._grouped_mm` (the experts of a mixture-of-experts layer) has a
    CPU kernel for float32 but a meta (shape) kernel that accepts only bf16/fp16, so on fake tensors a float32
    MoE would fail; its output shape does not depend on the dtype, so it is taken from the bf16 meta kernel
    and the output made float32, as the real kernel returns it.

    Under `make_fx` (the runtime's trace, `runtime.apply.trace_forward`) those casts must not become ops of the
    traced program: the placed step would then run the experts in bf16 (other numbers than the model's, and 4-6x
    slower on a CPU without bf16 matrix units) between two extra copies, none of which the capture recorded or
    the cost table priced. So the shape is computed with tracing off and the float32 call itself is traced."""
    if func.overloadpacket is _GROUPED_MM and any(t.dtype == torch.float32 for t in _tensors(args[:2])):
        from torch.fx.experimental.proxy_tensor import (
            disable_proxy_modes_tracing,
            get_proxy_mode,
            get_proxy_slot,
            track_tensor_tree,
        )

        def low(x: Any) -> Any:
            return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x

        tracing = get_proxy_mode()
        with disable_proxy_modes_tracing() if tracing is not None else nullcontext():
            out = func(*[low(a) for a in args], **{k: low(v) for k, v in kwargs.items()})
            out = out if kwargs.get("out_dtype") is not None else out.to(torch.float32)
        if tracing is not None:
            tracer = tracing.tracer
            p_args, p_kwargs = tree_map_only(torch.Tensor, lambda t: get_proxy_slot(t, tracer).proxy,
                                             (tuple(args), dict(kwargs)))
            track_tensor_tree(out, tracer.create_proxy("call_function", func, p_args, p_kwargs), constant=None,
                              tracer=tracer)
        return out
    return func(*args, **kwargs)


def _op_short_name(func: Any) -> str:
    name = getattr(func, "_opname", None) or str(func)
    ns = getattr(func, "namespace", "aten")
    return name if ns == "aten" else f"{ns}.{name}"


@dataclass(slots=True)
class _Value:
    """The current content of one storage: which node output wrote it, and its size as written."""

    node: int
    index: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    local: bool  # allocated during the step (an activation), not persistent (parameter, buffer, state)


@dataclass(slots=True)
class _Node:
    id: str
    op: str
    kind: str
    module: str
    group: int
    dtype: str = ""
    flops: int = 0
    mem_access_bytes: int = 0
    output_bytes: int = 0
    sig: dict[str, Any] | None = None
    inputs: list[tuple[int, int, _Value]] = field(default_factory=list)
    accumulates: list[dict[str, Any]] = field(default_factory=list)  # the adds into .grad of the gradients it makes


# ------------------------------------------------------------------------------------------ recorder
class Recorder(TorchDispatchMode):
    """Records the ATen ops of a training step (module docstring). `phase` None means: run, record nothing."""

    def __init__(self, persistent: Mapping[int, str]) -> None:
        super().__init__()
        self.phase: str | None = None
        self.nodes: list[_Node] = []
        self.values: dict[int, _Value] = {}
        self.persistent = dict(persistent)  # storage key -> parameter or buffer name
        self.first_consumer: dict[str, int] = {}  # parameter/buffer name -> first forward node reading it
        self.last_writer: dict[str, int] = {}  # parameter name -> last optimizer node writing it
        self.opt_storage: dict[int, str] = {}  # storage of a parameter, its gradient or its state -> name
        self.module_stack: list[str] = []
        self.param_module: dict[str, str] = {}
        self._fwd_peeks: list[int] = []  # autograd sequence number seen at each forward op node ...
        self._fwd_nodes: list[int] = []  # ... and that node
        self._counter: Counter[tuple[str, str]] = Counter()
        self._keep: list[Any] = []  # storages we key by address stay alive, so addresses are never reused
        self._writes: dict[Any, list[tuple[int, str]]] = {}
        self._has_cia: dict[Any, bool] = {}
        self._last_opt_group = -1
        self.current_op = ""  # the op being run, named in the error if the model fails during capture
        # dense shape -> the most bytes a sparse tensor of it held (values + indices): a coalesced sparse gradient
        # has a data-dependent size that fake tensors give as 0 stored values; the uncoalesced one it came from
        # holds one row per index the batch used, the most it can hold
        self.sparse_bytes: dict[tuple[int, ...], int] = {}

    def nbytes(self, t: torch.Tensor) -> int:
        """`_nbytes`, with a sparse tensor of unknown (0) stored size sized as the largest of its shape seen."""
        b = _nbytes(t)
        if t.layout == torch.strided:
            return b
        shape = tuple(t.shape)
        if b:
            self.sparse_bytes[shape] = max(b, self.sparse_bytes.get(shape, 0))
            return b
        return self.sparse_bytes.get(shape, 0)

    # ----------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDP_CHOICE:
            return self._sdp_choice(func, args, kwargs)
        if self.phase is None or func in _SKIP_OPS or getattr(func, "namespace", "") in _SKIP_NAMESPACES:
            return func(*args, **kwargs)
        # Like FlopCounterMode: an op with a CompositeImplicitAutograd kernel is recorded as its decomposition.
        has_cia = self._has_cia.get(func)
        if has_cia is None:
            has_cia = _CIA in getattr(func, "py_kernels", {}) or torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), _CIA)
            self._has_cia[func] = has_cia
        if has_cia:
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        peek = torch.autograd._get_sequence_nr() if self.phase == FORWARD else 0
        autograd_node = torch._C._current_autograd_node() if self.phase == BACKWARD else None
        self.current_op = target_name(func)
        out = _run_op(func, args, kwargs)
        self._record(func, args, kwargs, out, peek, autograd_node)
        return out

    @staticmethod
    def _sdp_choice(func: Any, args: Any, kwargs: Any) -> Any:
        """Which kernel `scaled_dot_product_attention` runs. Fake tensors answer "math" (the meta kernel);
        on the CPU we ask the CPU kernel, which reads only shapes, strides, dtypes and flags, so the capture
        records the attention kernel a real CPU run uses."""
        tensors = _tensors((args, kwargs))
        if tensors and all(t.device.type == "cpu" for t in tensors):
            with torch._C._DisableTorchDispatch():
                return func.redispatch(_CPU_KEYS, *args, **kwargs)
        return func(*args, **kwargs)

    def _written(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """Tensors the op writes in place (schema arguments annotated `(a!)`, e.g. `self` of `add_`, `out=`)."""
        spec = self._writes.get(func)
        if spec is None:
            spec = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write]
            self._writes[func] = spec
        if not spec:
            return []
        return _tensors([args[i] if i < len(args) else kwargs.get(n) for i, n in spec])

    def _record(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any, peek: int,
                autograd_node: Any) -> None:
        flat_in = _tensors((args, kwargs))
        flat_out = _tensors(out)
        # In-place view ops (`transpose_`, `squeeze_`, `set_`, ...) change a tensor's metadata, not its data.
        written = [] if torch.Tag.inplace_view in func.tags else self._written(func, args, kwargs)
        in_keys = {_key(t) for t in flat_in}
        written_keys = {_key(t) for t in written}
        produced: list[tuple[int, torch.Tensor, bool]] = []  # (storage, tensor, is a write)
        seen: set[int] = set()
        for t in flat_out:
            k = _key(t)
            if k in seen or (k in in_keys and k not in written_keys):
                continue  # a view or alias of an input: folded
            seen.add(k)
            produced.append((k, t, k in written_keys))
        for t in written:
            k = _key(t)
            if k not in seen:
                seen.add(k)
                produced.append((k, t, True))
        if not produced:
            # A view or alias (folded: it is its base's value), or an op that returns no tensor (.item()). The
            # autograd node of a forward view belongs with the op that produced the viewed tensor; a view of a
            # parameter or constant leaves it to the next op (the view's consumer).
            if self.phase == FORWARD and flat_out:
                base = self.values.get(_key(flat_out[0]))
                if base is not None and self.nodes[base.node].op != "input":
                    self._fwd_peeks.append(peek)
                    self._fwd_nodes.append(base.node)
            return

        idx = len(self.nodes)
        phase = self.phase
        assert phase is not None
        if phase == FORWARD:
            module = self.module_stack[-1] if self.module_stack else ""
            group = idx
        elif phase == BACKWARD:
            group = self._backward_group(autograd_node, flat_in)
            module = self.nodes[group].module
        else:
            group, module = self._optimizer_group(written + flat_in)

        node = _Node(id="", op=target_name(func), kind=phase, module=module, group=group,
                     dtype=_compute_dtype(flat_in, flat_out))
        seen_edges: set[tuple[int, int]] = set()
        for t in flat_in:
            k = _key(t)
            val = self.values.get(k)
            if val is not None and (val.node, val.index) not in seen_edges:
                seen_edges.add((val.node, val.index))
                node.inputs.append((val.node, val.index, val))
            if phase == FORWARD:
                name = self.persistent.get(k)
                if name is not None and name not in self.first_consumer:
                    self.first_consumer[name] = idx
        for j, (k, t, is_write) in enumerate(produced):
            prev = self.values.get(k)
            if not is_write:
                val = _Value(idx, j, self.nbytes(t), tuple(t.shape), _dtype(t), True)
                node.output_bytes += val.nbytes
                self._keep.append(t.untyped_storage() if k != id(t) else t)
            elif prev is not None:
                # Rewriting an activation in place produces a new value of it that later readers hold on to
                # (so it counts as output); rewriting a parameter, buffer or optimizer state does not.
                val = _Value(idx, j, prev.nbytes, prev.shape, prev.dtype, prev.local)
                if prev.local and INPLACE_REWRITE_ALLOCATES:
                    node.output_bytes += prev.nbytes
            else:
                val = _Value(idx, j, self.nbytes(t), tuple(t.shape), _dtype(t), False)
                self._keep.append(t)
            self.values[k] = val
            if phase == OPTIMIZER and is_write and k in self.persistent:
                self.last_writer[self.persistent[k]] = idx
        out_ids = {id(t) for t in flat_out}
        sparse_in = [t for t in flat_in if t.layout != torch.strided]
        touched = sum(self.nbytes(t) for t in sparse_in)

        def moved(t: torch.Tensor, nb: int) -> int:
            # with a sparse operand (`weight.add_(sparse gradient)`) a dense tensor is read or written at the
            # sparse one's rows only
            return self.nbytes(t) if t.layout != torch.strided else min(nb, touched) if sparse_in else nb

        node.mem_access_bytes = (sum(moved(t, _read_bytes(t)) for t in flat_in)
                                 + sum(moved(t, _nbytes(t)) for t in flat_out)
                                 + sum(moved(t, _nbytes(t)) for t in written if id(t) not in out_ids))
        node.flops = op_flops(func, args, dict(kwargs), out)
        node.sig = encode_signature(func, args, kwargs)
        short = _op_short_name(func)
        n = self._counter[(module, short)]
        self._counter[(module, short)] = n + 1
        node.id = f"{module}/{short}#{n}"
        self.nodes.append(node)
        if phase == FORWARD:
            self._fwd_peeks.append(peek)
            self._fwd_nodes.append(idx)

    # ----------------------------------------------------------------- groups
    def _fallback_group(self, inputs: Sequence[torch.Tensor]) -> int:
        """The group of the first operand that an op produced, else the last forward op."""
        for t in inputs:
            val = self.values.get(_key(t))
            if val is not None and self.nodes[val.node].op != "input":
                return self.nodes[val.node].group
        return self._fwd_nodes[-1]

    def _backward_group(self, autograd_node: Any, inputs: Sequence[torch.Tensor]) -> int:
        if autograd_node is None:  # outside any autograd node: the loss's seed gradient, engine buffers
            return self._fallback_group(inputs)
        seq = int(autograd_node._sequence_nr())
        if seq == _NO_SEQUENCE:  # AccumulateGrad: colocate with the parameter's first forward consumer
            var = getattr(autograd_node, "variable", None)
            name = self.persistent.get(_key(var)) if isinstance(var, torch.Tensor) else None
            if name is not None and name in self.first_consumer:
                return self.first_consumer[name]
            return self._fallback_group(inputs)
        # The autograd node was created just before its forward op's dispatch reached us, so it belongs to the
        # first forward op whose sequence-number peek is past it (a folded view noted its base's producer).
        i = bisect.bisect_right(self._fwd_peeks, seq)
        return self._fwd_nodes[min(i, len(self._fwd_nodes) - 1)]

    def _optimizer_group(self, tensors: Sequence[torch.Tensor]) -> tuple[int, str]:
        for t in tensors:
            name = self.opt_storage.get(_key(t))
            if name is not None and name in self.first_consumer:
                self._last_opt_group = self.first_consumer[name]
                return self._last_opt_group, self.param_module.get(name, "")
        group = self._last_opt_group if self._last_opt_group >= 0 else self._fallback_group(tensors)
        return group, self.nodes[group].module

    def note_optimizer_storage(self, t: torch.Tensor | None, name: str) -> None:
        """Storage `t` (parameter `name`, its gradient, master copy or optimizer state) belongs to `name`'s
        update. `t` is kept alive: a master copy's gradient is replaced by the recorded step, and a freed
        storage's address could be reused by a temporary that would then be taken for `name`'s."""
        if t is None:
            return
        self.opt_storage.setdefault(_key(t), name)
        self._keep.append(t)

    # ----------------------------------------------------------------- inputs and modules
    def add_input(self, name: str, t: torch.Tensor) -> None:
        k = _key(t)
        if k in self.values:
            return  # the same tensor passed twice
        idx = len(self.nodes)
        nb = _nbytes(t)
        self.nodes.append(_Node(id=f"input/{name}", op="input", kind=FORWARD, module="", group=idx,
                                dtype=_dtype(t), output_bytes=nb))
        self.values[k] = _Value(idx, 0, nb, tuple(t.shape), _dtype(t), True)
        self._keep.append(t)

    def push(self, name: str) -> None:
        self.module_stack.append(name)

    def pop(self, name: str) -> None:
        if self.module_stack and self.module_stack[-1] == name:
            self.module_stack.pop()


@contextmanager
def module_hooks(model: nn.Module, rec: Recorder) -> Iterator[None]:
    """Tell `rec` which module is running: its path is pushed before each module's forward and popped after
    (the `module` of recorded ops). devplace.runtime traces with the same hooks, so its op ids match."""
    handles = []
    try:
        for name, mod in model.named_modules():
            handles.append(mod.register_forward_pre_hook(lambda _m, _a, name=name: rec.push(name)))
            handles.append(mod.register_forward_hook(lambda _m, _a, _o, name=name: rec.pop(name), always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------------ fake tensors
def _model_fake_mode(model: nn.Module, inputs: Any) -> FakeTensorMode | None:
    modes = {id(t.fake_mode): t.fake_mode for t in [*model.parameters(), *model.buffers(), *_tensors(inputs)]
             if isinstance(t, FakeTensor)}
    if len(modes) > 1:
        raise CaptureError("the model and its inputs hold fake tensors of more than one FakeTensorMode; "
                           "build them all under one mode")
    return next(iter(modes.values()), None)


def _to_fake(t: torch.Tensor, mode: FakeTensorMode, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake tensor of `mode` with t's shape, stride, dtype and requires_grad (meta tensors land on the CPU);
    with `dtype`, a floating-point tensor is cast to it (as `module.to(dtype)` casts parameters and buffers)."""
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        f = _to_fake(t, mode).detach()
        with mode:
            f = f.to(dtype)
        return f.requires_grad_(t.requires_grad)
    if isinstance(t, FakeTensor):
        if t.fake_mode is not mode:
            raise CaptureError("a tensor of the model or inputs is fake under another FakeTensorMode")
        return t
    if t.device.type == "meta":
        with mode:
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    else:
        f = mode.from_tensor(t)
    if t.requires_grad and not f.requires_grad:
        f.requires_grad_(True)
    if f is not t and f.grad is not None:
        f.grad = None  # the step starts with gradients set to None (optimizer.zero_grad())
    return f


@contextmanager
def _fake_model(model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None = None,
                ) -> Iterator[dict[int, torch.Tensor]]:
    """Swap every parameter and buffer of `model` for a fake one (tied tensors stay tied), floating-point ones
    cast to `dtype` if given; restore on exit.

    Yields {id(original tensor): fake tensor}. Gradients the step leaves on fake tensors the caller passed
    in are reset on exit too.
    """
    memo: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    old_grads: list[tuple[torch.Tensor, Any]] = []
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for k, t in list(store.items()):
                    if t is None:
                        continue
                    f = memo.get(id(t))
                    if f is None:
                        f = _to_fake(t, mode, dtype)
                        memo[id(t)] = f
                        if f is t:
                            old_grads.append((t, t.grad))
                            t.grad = None
                    if f is not t:
                        swapped.append((store, k, t))
                        store[k] = f
        yield memo
    finally:
        for store, k, t in swapped:
            store[k] = t
        for t, g in old_grads:
            t.grad = g


def _split_inputs(model: nn.Module, example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any],
                                                                  list[tuple[str, Any]]]:
    """(args, kwargs, [(name, top-level value)]) from a tensor, a tuple/list of arguments or a dict of kwargs."""
    if isinstance(example_inputs, Mapping):
        kwargs = dict(example_inputs)
        return (), kwargs, [(str(k), v) for k, v in kwargs.items()]
    args = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [params[i] if i < len(params) else f"arg{i}" for i in range(len(args))]
    return args, {}, list(zip(names, args, strict=True))


def _convert_tree(x: Any, mode: FakeTensorMode, dtype: torch.dtype | None = None) -> Any:
    if isinstance(x, torch.Tensor):
        return _to_fake(x, mode, dtype)
    if isinstance(x, tuple | list):
        return type(x)(_convert_tree(i, mode, dtype) for i in x)
    if isinstance(x, dict):
        return {k: _convert_tree(v, mode, dtype) for k, v in x.items()}
    return x


def _named_leaves(name: str, x: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(x, torch.Tensor):
        yield name, x
    elif isinstance(x, tuple | list):
        for i, v in enumerate(x):
            yield from _named_leaves(f"{name}.{i}", v)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _named_leaves(f"{name}.{k}", v)


# ------------------------------------------------------------------------------------------ loss, optimizer
def default_loss(output: Any) -> torch.Tensor:
    """The model's own loss if it returns one (a one-element tensor, or `output.loss` as Hugging Face models
    give with labels), else the sum of every floating-point output that requires grad."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output  # the model returns its loss
    loss = getattr(output, "loss", None) if not isinstance(output, torch.Tensor) else None
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping):
        output = list(output.values())
    parts = [t for t in _tensors(output) if t.requires_grad and (t.is_floating_point() or t.is_complex())]
    if not parts:
        raise CaptureError("the model's output has no floating-point tensor that depends on a trainable "
                           "parameter, so there is no backward pass to capture; pass loss_fn=")
    total = parts[0].sum()
    for t in parts[1:]:
        total = total + t.sum()
    return total


def loss_reduction(output: Any, loss_fn_given: bool) -> str:
    """How a step's loss combines its micro-batches' (and what torch's pipelining does with their gradients):
    "mean" for a given loss function or the model's own loss (a one-element output, `output.loss`), a mean over
    the batch, whose micro-batch gradients the pipeline divides by M (`stage.scale_grads`); "sum" where
    `default_loss` sums the outputs."""
    own = (loss_fn_given or (isinstance(output, torch.Tensor) and output.numel() == 1)
           or isinstance(getattr(output, "loss", None), torch.Tensor))
    return "mean" if own else "sum"


def _optimizer_factory(optimizer: OptimizerSpec) -> tuple[Callable[[list[torch.Tensor]], Any] | None, str]:
    if callable(optimizer):
        return optimizer, "custom"  # named after the optimizer's class once it is built
    if optimizer == "adam":
        return (lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False)), "adam"
    if optimizer == "sgd":
        return (lambda ps: torch.optim.SGD(ps, lr=1e-2, foreach=False)), "sgd"
    if optimizer == "none":
        return None, "none"
    raise CaptureError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)} or a callable "
                       "that makes a torch.optim.Optimizer from a list of parameters")


def _state_bytes(state: Mapping[str, Any], p: torch.Tensor) -> int:
    """Per-element optimizer state of one parameter (tensors of its shape: Adam's moments, SGD's momentum)."""
    return sum(_nbytes(v) for k, v in state.items()
               if k != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape)


def _master_step(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], masters: Mapping[int, torch.Tensor],
                 ) -> None:
    """One optimizer step; a parameter with an fp32 master copy (`masters`, by id) has its gradient cast to the
    copy, the copy updated, and the copy cast back into the parameter."""
    pairs = [(p, masters[id(p)]) for p in params if id(p) in masters]
    for p, m in pairs:
        m.grad = p.grad.to(torch.float32)
    opt.step()
    with torch.no_grad():
        for p, m in pairs:
            p.copy_(m)


def _fresh_state(opt: torch.optim.Optimizer) -> bool:
    """Give the optimizers `capture` builds itself (Adam, plain SGD) the state their first step would leave,
    without running one: the recorded step is then a steady one, as after an unrecorded warm-up step, which
    costs as much on fake tensors as the recorded step (about 1.8 CPU-s of gpt2-xl's 11 s capture). False
    for any other optimizer, which gets the warm-up step."""
    if type(opt) is torch.optim.SGD:
        return all(not g["momentum"] for g in opt.param_groups)
    if type(opt) is not torch.optim.Adam or any(g["amsgrad"] or g["fused"] or g["capturable"] or g["foreach"]
                                                 for g in opt.param_groups):
        return False
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # as torch.optim's
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(1.0, dtype=scalar),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return True


def _precision(dtype: str | None, amp: bool) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(dtype to cast parameters, buffers and inputs to, autocast dtype) for `capture(dtype=, amp=)`."""
    if dtype is not None and dtype not in DTYPES:
        raise CaptureError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} (or leave it out to keep the "
                           "model's own dtypes)")
    if not amp:
        return (DTYPES[dtype] if dtype is not None else None), None
    auto = DTYPES[dtype or "bf16"]
    if auto not in _LOW_PRECISION:
        raise CaptureError(f"amp (autocast) needs a low precision to cast to, got dtype={dtype!r}; use amp with "
                           "dtype bf16 or fp16, or dtype fp32 without amp")
    return None, auto


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs the whole traceback of an op whose meta kernel fails before raising it; the error is
    reported as one CaptureError line instead, so the log is silenced for the capture."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


# ------------------------------------------------------------------------------------------ capture
def capture(model: nn.Module, example_inputs: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
            optimizer: OptimizerSpec = "adam", name: str | None = None, dtype: str | None = None,
            amp: bool = False) -> CompGraph:
    """Capture one training step of `model` on `example_inputs` as a graph (docs/capture-format.md).

    `example_inputs`: a tensor, a tuple/list of positional arguments, or a dict of keyword arguments; real,
    meta or fake tensors (nested lists/dicts of tensors are fine). The model's parameters and buffers may
    be real, on the meta device, or fake (built under a `FakeTensorMode`); nothing is computed for real and
    the model is left as it was. `loss_fn(output) -> tensor` (default: the model's own `.loss` if it
    returns one, else the sum of its outputs; a non-scalar loss is summed). `optimizer`: "adam"
    (torch.optim.Adam), "sgd" (plain SGD), "none" (forward and backward only), or a callable that builds a
    `torch.optim.Optimizer` from a list of parameters (use `foreach=False` to keep one update per parameter).

    Precision (docs/capture-format.md, "Precision"): `dtype` ("fp32", "bf16", "fp16"; default: the model's own) casts
    the floating-point parameters, buffers and inputs, as `model.to(dtype)` would, so the whole step runs in
    it (the optimizer state too, as torch.optim keeps it in the parameter's dtype). `amp=True` runs the
    forward and the loss under `torch.autocast` to `dtype` (bf16 when not given) and casts nothing: fp32
    parameters are their own master weights. Under `amp`, parameters that are bf16/fp16 in the model are
    trained as mixed-precision optimizers do: the recorded step casts each gradient to an fp32 master copy,
    updates the copy (optimizer state in fp32) and copies it back; the copy's 4 bytes per element are in
    param_bytes (and meta `master_weight_bytes`). Every node gets its compute dtype (`dtype` key).
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    make_opt, opt_name = _optimizer_factory(optimizer)
    cast, autocast_dtype = _precision(dtype, amp)
    loss_given = loss_fn is not None
    loss_fn = loss_fn or default_loss
    mode = _model_fake_mode(model, example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    named_params = list(model.named_parameters())
    named_buffers = list(model.named_buffers())

    with _quiet_fake_tensor_log(), _fake_model(model, mode, cast) as memo:
        params = [(n, memo[id(p)]) for n, p in named_params]
        buffers = [(n, memo[id(b)]) for n, b in named_buffers]
        persistent = {_key(t): n for n, t in [*params, *buffers]}
        rec = Recorder(persistent)
        rec.param_module = {n: n.rpartition(".")[0] for n, _ in [*params, *buffers]}
        args, kwargs, named_inputs = _split_inputs(model, example_inputs)
        args = _convert_tree(args, mode, cast)
        kwargs = _convert_tree(kwargs, mode, cast)
        fake_inputs = args if not kwargs else tuple(kwargs.values())
        named_leaves = [leaf for (n, _), v in zip(named_inputs, fake_inputs, strict=True)
                        for leaf in _named_leaves(n, v)]
        opt = None
        masters: dict[int, torch.Tensor] = {}  # id(parameter) -> its fp32 master copy (amp with bf16/fp16 params)
        try:
            with ExitStack() as stack:
                if mode not in _get_current_dispatch_mode_stack():
                    stack.enter_context(mode)
                stack.enter_context(module_hooks(model, rec))
                stack.enter_context(rec)
                for n, t in named_leaves:
                    rec.add_input(n, t)
                rec.phase = FORWARD
                with torch.enable_grad(), ExitStack() as autocast:
                    if autocast_dtype is not None:  # fake tensors live on the CPU: its autocast op lists apply
                        autocast.enter_context(torch.autocast("cpu", dtype=autocast_dtype))
                    output = model(*args, **kwargs)
                    reduction = loss_reduction(output, loss_given)
                    loss = loss_fn(output)
                    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                        raise CaptureError("the loss must be a tensor that depends on a trainable parameter; "
                                           f"got {type(loss).__name__}")
                    if loss.numel() != 1:
                        loss = loss.sum()
                if len(rec._fwd_nodes) == 0:
                    raise CaptureError("the forward pass ran no ATen op; nothing to capture")
                rec.phase = BACKWARD
                loss.backward()
                rec.phase = None
                # A gradient is counted once, in param_bytes (it lives in .grad for the rest of the step), so
                # the backward op that allocates it does not count it again as its output. Under micro-batches
                # every later micro-batch's gradient is added into .grad in place (AccumulateGrad's `+=`): that
                # add is recorded on the op that makes the gradient (a sparse gradient's is not modelled).
                for _, p in params:
                    val = rec.values.get(_key(p.grad)) if p.grad is not None else None
                    if val is not None and val.local:
                        node = rec.nodes[val.node]
                        node.output_bytes = max(0, node.output_bytes - val.nbytes)
                        if p.grad.layout == torch.strided:  # and, of a mean loss, its division by M once a step
                            node.accumulates.append({
                                "sig": encode_signature(torch.ops.aten.add_.Tensor, (p.grad, p.grad)),
                                "scale_sig": encode_signature(torch.ops.aten.div_.Tensor, (p.grad, SCALE_BY)),
                                "bytes": rec.nbytes(p.grad)})
                trainable = [p for _, p in params if p.requires_grad and p.grad is not None]
                if make_opt is not None and trainable:
                    # Mixed precision with bf16/fp16 parameters: the optimizer updates an fp32 master copy of each
                    # (made here, unrecorded: it persists across steps), as Apex O2, DeepSpeed and Megatron do.
                    masters = {id(p): p.detach().to(torch.float32).requires_grad_(True) for p in trainable
                               if amp and p.dtype in _LOW_PRECISION}
                    opt = make_opt([masters.get(id(p), p) for p in trainable])
                    if not isinstance(opt, torch.optim.Optimizer):
                        raise CaptureError(f"optimizer= must build a torch.optim.Optimizer, got {type(opt).__name__}")
                    if callable(optimizer):
                        opt_name = type(opt).__name__.lower()
                    if masters or not _fresh_state(opt):  # master copies get their .grad from a step
                        _master_step(opt, trainable, masters)  # unrecorded warm-up: creates the state
                    for n, p in params:
                        if p.grad is None:
                            continue
                        updated = masters.get(id(p), p)
                        state = [v for v in opt.state.get(updated, {}).values() if isinstance(v, torch.Tensor)]
                        for t in (p, p.grad, updated, updated.grad, *state):
                            rec.note_optimizer_storage(t, n)
                    rec.phase = OPTIMIZER
                    _master_step(opt, trainable, masters)
                    rec.phase = None
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise CaptureError(f"the model runs an op whose result depends on tensor values ({exc}); capture "
                               "traces with fake tensors that have shapes but no values, so data-dependent "
                               "control flow or output shapes (.item(), nonzero, boolean masks) cannot be "
                               "captured; make that part of the model value-independent") from exc
        except UnsupportedOperatorException as exc:
            raise CaptureError(f"the op {exc} cannot run on fake tensors, so the model cannot be captured") from exc
        except RuntimeError as exc:  # the model (or an op's shape check) failed: one line, not torch's traceback
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            where = f" in module {rec.module_stack[-1]!r}" if rec.module_stack else ""
            raise CaptureError(f"the model failed during the {rec.phase or 'training'} step at "
                               f"{rec.current_op or 'an op'}{where}: {first}; check that it runs with these "
                               f"inputs and this precision (dtype={dtype!r}, amp={amp})") from exc
        finally:
            rec.phase = None

        # persistent memory: weights + gradient + optimizer state on the op that owns the update
        param_bytes = [0] * len(rec.nodes)
        first_op = next((i for i, nd in enumerate(rec.nodes) if nd.op != "input"), 0)
        total_param_bytes = total_buffer_bytes = n_params = master_bytes = 0
        for n, p in params:
            master = masters.get(id(p)) if opt is not None else None
            updated = master if master is not None else p
            state = opt.state.get(updated, {}) if opt is not None else {}
            b = _nbytes(p) + (rec.nbytes(p.grad) if p.grad is not None else 0) + _state_bytes(state, updated)
            if master is not None:
                b += _nbytes(master)
                master_bytes += _nbytes(master)
            owner = rec.last_writer.get(n, rec.first_consumer.get(n, first_op))
            param_bytes[owner] += b
            total_param_bytes += b
            n_params += int(p.numel())
        for n, t in buffers:
            param_bytes[rec.first_consumer.get(n, first_op)] += _nbytes(t)
            total_buffer_bytes += _nbytes(t)
        dtypes = Counter({})
        for _, p in params:
            dtypes[_dtype(p)] += _nbytes(p)
        batch_t = next((t for _, t in named_leaves if t.dim() >= 1), None)

    batch = int(batch_t.shape[0]) if batch_t is not None else None
    meta = {"capture": {
        "frontend": "torch", "torch": torch.__version__, "model": type(model).__name__, "batch": batch,
        "loss_reduction": reduction,
        "optimizer": opt_name, "dtype": dtypes.most_common(1)[0][0] if dtypes else None,
        "params": n_params, "param_bytes": total_param_bytes, "buffer_bytes": total_buffer_bytes,
        "amp": _dtype(torch.empty(0, dtype=autocast_dtype)) if autocast_dtype is not None else None,
        "master_weight_bytes": master_bytes,
        # what PyTorch's flags say now: fp32 matmuls and convolutions may run on TF32 tensor cores
        "tf32": {"matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                 "convolution": bool(torch.backends.cudnn.allow_tf32)},
    }, SEMANTICS_KEY: Semantics.AUTOGRAD.value}  # captured to be run: placed as autograd runs it
    return _build(name or f"{type(model).__name__}-b{batch}", rec.nodes, param_bytes, meta)


def _build(name: str, nodes: list[_Node], param_bytes: list[int], meta: dict[str, Any]) -> CompGraph:
    node_recs: list[dict[str, Any]] = []
    edge_recs: list[dict[str, Any]] = []
    for i, nd in enumerate(nodes):
        rec: dict[str, Any] = {"id": nd.id, "op": nd.op, "kind": nd.kind, "output_bytes": nd.output_bytes}
        if param_bytes[i]:
            rec["param_bytes"] = param_bytes[i]
        rec.update({"group": nodes[nd.group].id, "flops": nd.flops, "mem_access_bytes": nd.mem_access_bytes,
                    "module": nd.module})
        if nd.dtype:
            rec["dtype"] = nd.dtype
        if nd.sig is not None:
            rec["sig"] = nd.sig
        if nd.accumulates:
            rec[ACCUMULATES_KEY] = nd.accumulates
            rec[ACCUMULATE_BYTES_KEY] = sum(a["bytes"] for a in nd.accumulates)
        node_recs.append(rec)
        for src, k, val in nd.inputs:
            edge_recs.append({"src": nodes[src].id, "dst": nd.id, "bytes": val.nbytes, "tensor": k,
                              "shape": list(val.shape), "dtype": val.dtype})
    return CompGraph.build(name, node_recs, edge_recs, meta)
