"""Run a module's forward with each op on its placed device (docs/runtime.md).

How a placement of the captured training graph becomes a running module:

1. **Trace.** The module's forward is traced to ATen ops with `make_fx` on fake CPU tensors, under the very
   recorder that `devplace.capture` uses (`Recorder`, same module hooks, same decomposition of
   CompositeImplicitAutograd ops, same view folding). Every ATen op the recorder turns into a graph node
   gets that node's id (``module/op#n``) on the fx node it created, so the mapping from traced ops to
   captured ops is *by construction* the capture's own naming, not a heuristic. The tagged ids are then
   checked against the captured graph: they must be exactly its forward ops, in the same order (ops after
   the model's forward, i.e. the loss the capture added, may remain). If they are not (a model whose trace
   differs from its capture), placement falls back to **module granularity** (every op of module M runs
   where M's first captured op runs) and `PlacedModule.granularity` says "module", with a warning.
2. **Run.** A small interpreter executes the traced ATen graph at the Python level, *above* autograd:
   before a placed op runs, its tensor inputs that live on another device are copied there with `.to()`
   (once per tensor and device per forward), so autograd records the copies and `loss.backward()` runs
   each backward op on its forward op's device, gradients flowing back through the copies. Ops that are
   not nodes of the capture (views, `getitem`) run where their input is. A factory op's `device=` is
   rewritten to its placed device. When every op and every parameter is on one logical device and that device
   is the CPU the trace was made on (a one-device plan run as `devplace run --plan` runs it), there is nothing
   to move or rewrite, and the traced program's own generated Python code runs instead (as a pipeline stage's
   does): the same ATen calls in the same order, without the interpreter's 5-8 us of Python per traced call.
3. **Parameters and buffers** are moved (in place, `param.data = ...`, so optimizers built before or after
   see the same Parameter objects) to the device of their first consumer op, which is where the capture
   puts their gradient accumulation and optimizer update; the optimizer then steps there.

An in-place op whose mutated tensor lives on another device than the op's placement (a batch-norm buffer
read first elsewhere, an in-place ReLU on a tensor made on another device) runs on the mutated tensor's
device instead, so the mutation is not lost on a copy; `PlacedModule.deviations` counts them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from devplace.capture.torch_capture import FORWARD, Recorder, module_hooks
from devplace.defaults import MAX_DEVICES
from devplace.errors import PlacementError
from devplace.graph.compgraph import CompGraph
from devplace.graph.placement import Placement, runtime_placement

__all__ = ["ApplyError", "PlacedModule", "apply_placement", "first_consumers", "forward_devices",
           "normalize_devices", "runtime_placement", "state_first_ops"]


class ApplyError(PlacementError):
    """A placement cannot be applied to this module on these devices."""


# ------------------------------------------------------------------------------------------ tracing
class _IdRecorder(Recorder):
    """The capture's recorder, also naming the fx node each recorded op became (under `make_fx`)."""

    def __init__(self) -> None:
        super().__init__({})
        self.fx_ids: dict[fx.Node, tuple[str, str]] = {}  # fx node -> (captured node id, module path)

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any, peek: int, autograd_node: Any) -> None:
        before = len(self.nodes)
        super()._record(func, args, kwargs, out, peek, autograd_node)
        if len(self.nodes) == before:
            return  # folded (a view): not a node of the captured graph
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            return
        # `func` has just run through make_fx's proxy mode, which appended its call_function node (and maybe
        # getitem nodes after it): the newest node with this target is the one.
        for node in reversed(mode.tracer.graph.nodes):
            if node.op == "call_function" and node.target is func:
                self.fx_ids[node] = (self.nodes[-1].id, self.nodes[-1].module)
                break


@dataclass
class _Trace:
    gm: fx.GraphModule
    ids: dict[str, tuple[str, str]]  # fx node name -> (captured id, module)
    out_spec: Any
    n_state: int  # placeholders for parameters and buffers come first


def _state(model: nn.Module) -> tuple[list[str], list[torch.Tensor], int]:
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    names = [n for n, _ in params] + [n for n, _ in buffers]
    return names, [t for _, t in params] + [t for _, t in buffers], len(params)


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor like `t` (called under the fake mode): tracing always sees CPU tensors, whatever the
    real devices, so the ops traced are the ops the capture (also on CPU fakes) recorded."""
    f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    return f.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else f


def trace_forward(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Trace:
    """Trace `model(*args, **kwargs)` to an ATen fx graph whose op nodes carry the capture's node ids."""
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    names, state, _ = _state(model)
    leaves, in_spec = tree_flatten((tuple(args), dict(kwargs)))
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    rec = _IdRecorder()
    out_spec: list[Any] = []

    def step(state_t: list[torch.Tensor], tensor_leaves: list[torch.Tensor]) -> list[Any]:
        it = iter(tensor_leaves)
        full = [next(it) if t else x for x, t in zip(leaves, is_tensor, strict=True)]
        a, kw = tree_unflatten(full, in_spec)
        with module_hooks(model, rec), rec:
            rec.phase = FORWARD
            try:
                out = functional_call(model, dict(zip(names, state_t, strict=True)), tuple(a), kw)
            finally:
                rec.phase = None
        flat, spec = tree_flatten(out)
        out_spec.append(spec)
        return flat

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_state = [_fake_like(t) for t in state]
        fake_leaves = [_fake_like(x) for x, t in zip(leaves, is_tensor, strict=True) if t]
        with torch.enable_grad():
            gm = make_fx(step, tracing_mode="real")(fake_state, fake_leaves)
    ids = {node.name: v for node, v in rec.fx_ids.items()}
    return _Trace(gm, ids, out_spec[-1], len(state))


def first_consumers(trace: _Trace) -> dict[str, str]:
    """Placeholder name of each parameter and buffer -> the fx node of the first captured op that reads it
    (through views: a view of a parameter is still that parameter); unread ones are left out."""
    placeholders = [n for n in trace.gm.graph.nodes if n.op == "placeholder"]
    state_names = {n.name for n in placeholders[:trace.n_state]}
    root: dict[str, str] = {n.name: n.name for n in placeholders}
    out: dict[str, str] = {}
    for node in trace.gm.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if node.name in trace.ids:
            for a in inputs:
                r = root.get(a.name)
                if r in state_names and r not in out:
                    out[r] = node.name
        elif inputs and inputs[0].name in root:
            root[node.name] = root[inputs[0].name]
    return out


def state_first_ops(model: nn.Module, example_inputs: Any) -> dict[str, str]:
    """Name of each parameter and buffer of `model` (as `named_parameters()`/`named_buffers()` give them) ->
    the captured op id of its first forward consumer on `example_inputs` (as for `capture`); unread ones are
    left out. Exact: the trace names its ops as the capture does."""
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, tuple | list):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    trace = trace_forward(model, args, kwargs)
    names, _, _ = _state(model)
    placeholders = [n.name for n in trace.gm.graph.nodes if n.op == "placeholder"][:trace.n_state]
    by_ph = dict(zip(placeholders, names, strict=True))
    return {by_ph[ph]: trace.ids[op][0] for ph, op in first_consumers(trace).items()}


# ------------------------------------------------------------------------------------------ mapping
def normalize_devices(devices: Sequence[str | torch.device] | str) -> list[torch.device]:
    """Real devices, one per logical device index (`"cuda:0,cuda:1"` or a list); checked to exist."""
    items = devices.split(",") if isinstance(devices, str) else list(devices)
    if len(items) > MAX_DEVICES:
        raise ApplyError(f"{len(items):,} devices given, more than the limit of {MAX_DEVICES:,}")
    out: list[torch.device] = []
    for d in items:
        try:
            dev = torch.device(d.strip() if isinstance(d, str) else d)
        except (RuntimeError, TypeError) as exc:
            raise ApplyError(f"{d!r} is not a torch device; use e.g. cpu, cuda:0, cuda:1") from exc
        if dev.type not in ("cpu", "cuda"):  # meta holds no data, mps/xla/... are not what apply moves modules to
            raise ApplyError(f"device {dev} cannot run training steps here; use cpu or cuda devices")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ApplyError(f"device {dev} needs CUDA, and torch sees no CUDA GPU; use cpu devices "
                                    "(several logical devices may map to the same real one: cpu,cpu,cpu)")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.index >= torch.cuda.device_count():
                raise ApplyError(f"device {dev} does not exist: torch sees {torch.cuda.device_count()} GPU(s)")
        out.append(dev)
    if not out:
        raise ApplyError("no devices given; pass one real device per logical device, e.g. cuda:0,cuda:1")
    return out


def forward_devices(graph: CompGraph, placement: Placement) -> dict[str, int]:
    """Logical device of every forward op of `graph` under `placement` (a placement of `graph`'s ops)."""
    if placement.graph and graph.name and placement.graph != graph.name:
        raise ApplyError(f"the placement is for graph {placement.graph!r}, not {graph.name!r}; apply a "
                            "placement of the captured graph of this model (devplace.plan does both)")
    devs = placement.to_array(graph, max(placement.assignment.values(), default=0) + 1)
    return {graph.ids[v]: int(devs[v]) for v in range(graph.num_nodes)
            if graph.kind[v] == FORWARD and graph.op[v] != "input"}


def _exact_mapping(trace: _Trace, graph: CompGraph) -> bool:
    """True iff the traced ops are exactly the graph's forward ops, in order (a trailing remainder -- the loss
    the capture added after the model's forward -- allowed)."""
    traced = [v[0] for v in trace.ids.values()]
    captured = [graph.ids[v] for v in range(graph.num_nodes) if graph.kind[v] == FORWARD and graph.op[v] != "input"]
    if traced != captured[:len(traced)]:
        return False
    ops = {graph.ids[v]: graph.op[v] for v in range(graph.num_nodes)}
    names = {n.name: n for n in trace.gm.graph.nodes}
    from devplace.capture.signature import target_name

    return all(ops[cid] == target_name(names[fx_name].target) for fx_name, (cid, _) in trace.ids.items())


def _module_devices(graph: CompGraph, op_device: Mapping[str, int]) -> dict[str, int]:
    """Device of each module: where its first captured forward op runs."""
    out: dict[str, int] = {}
    for v in range(graph.num_nodes):
        nid = graph.ids[v]
        if nid in op_device:
            out.setdefault(str(graph.node_extra[v].get("module", "")) if graph.node_extra else "", op_device[nid])
    return out


# ------------------------------------------------------------------------------------------ running
def _mutated_positions(target: Any) -> list[tuple[int, str]]:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    return [(i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


@dataclass
class _Step:
    node: fx.Node
    device: int | None  # logical device, None: where the first tensor input is
    mutates: list[tuple[int, str]] = field(default_factory=list)
    free: list[str] = field(default_factory=list)  # env entries whose last use is this step


class PlacedModule(nn.Module):
    """`module` with its forward run op by op on the placed devices (see the module docstring).

    `parameters()` are the original module's (moved to their devices), so an optimizer built on either works.
    The forward is traced on first use and again when the input shapes or the training mode change.
    """

    def __init__(self, module: nn.Module, graph: CompGraph, placement: Placement,
                 devices: Sequence[str | torch.device] | str) -> None:
        super().__init__()
        self.module = module
        self.graph = graph
        self.devices = normalize_devices(devices)
        self.op_device = forward_devices(graph, placement)
        used = max(self.op_device.values(), default=0) + 1
        if used > len(self.devices):
            raise ApplyError(f"the placement uses {used} devices (0..{used - 1}) but {len(self.devices)} "
                                f"real device(s) were given ({', '.join(map(str, self.devices))}); give one per "
                                "logical device (the same real device may repeat: cpu,cpu,cpu)")
        self._check_model(module, graph)
        self.module_device = _module_devices(graph, self.op_device)
        self.granularity = "op"
        self.deviations = 0
        self.crossings = 0  # logical device crossings (tensor, consumer device) of the last forward
        # input key -> (trace, its steps, parameter homes, whether its generated code runs as it is: `_runs_direct`)
        self._traces: dict[Any, tuple[_Trace, list[_Step], dict[str, int], bool]] = {}

    @staticmethod
    def _check_model(module: nn.Module, graph: CompGraph) -> None:
        cap = graph.meta.get("capture") if isinstance(graph.meta, Mapping) else None
        if not isinstance(cap, Mapping):
            return
        want_cls, want_params = cap.get("model"), cap.get("params")
        have_params = sum(int(p.numel()) for p in module.parameters())
        if (want_cls and want_cls != type(module).__name__) or (want_params is not None and want_params != have_params):
            raise ApplyError(f"the plan's graph {graph.name!r} was captured from a {want_cls} with {want_params} "
                                f"parameters, but this module is a {type(module).__name__} with {have_params}; "
                                "apply a plan made for this model")

    # ----------------------------------------------------------------- preparing a trace
    def prepare(self, *args: Any, **kwargs: Any) -> None:
        """Trace for these inputs and move parameters and buffers to their devices (done by the first call)."""
        self._trace_for(args, kwargs)

    def _key(self, args: Any, kwargs: Any) -> Any:
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        shapes = tuple((tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else repr(x)
                       for x in leaves)
        return (self.module.training, str(spec), shapes)

    def _trace_for(self, args: Any, kwargs: Any) -> tuple[_Trace, list[_Step], dict[str, int], bool]:
        key = self._key(args, kwargs)
        hit = self._traces.get(key)
        if hit is not None:
            return hit
        trace = trace_forward(self.module, args, kwargs)
        exact = _exact_mapping(trace, self.graph)
        if not exact:
            self._module_fallback(trace)
        steps, homes = self._steps(trace, exact)
        self._move_state(trace, homes)
        self._traces[key] = (trace, steps, homes, self._runs_direct(steps, homes))
        return self._traces[key]

    def _runs_direct(self, steps: Sequence[_Step], homes: Mapping[str, int]) -> bool:
        """Whether the traced program can run as its own generated code: every op and every parameter on one
        logical device, and that device the CPU (the trace's device, so no factory op needs another `device=`,
        no kernel lays its output out differently from the traced one, and nothing is copied or crosses)."""
        used = {s.device for s in steps if s.device is not None} | set(homes.values())
        return len(used) <= 1 and self.devices[next(iter(used), 0)] == torch.device("cpu")

    def _module_fallback(self, trace: _Trace) -> None:
        unknown = sorted({m for _, m in trace.ids.values() if m not in self.module_device})
        if unknown:
            raise ApplyError(f"this module's forward runs ops in module(s) the plan's graph {self.graph.name!r} "
                                f"never saw, e.g. {unknown[0]!r}: the placement is for another model")
        self.granularity = "module"
        warnings.warn(f"the traced forward of {type(self.module).__name__} does not match its captured graph op for "
                      "op; placing at module granularity (each module's ops where its first captured op runs)",
                      stacklevel=3)

    def _device_of(self, trace: _Trace, name: str, exact: bool) -> int:
        cid, module = trace.ids[name]
        if exact:
            return self.op_device[cid]
        return self.module_device[module]

    def _steps(self, trace: _Trace, exact: bool) -> tuple[list[_Step], dict[str, int]]:
        steps: list[_Step] = []
        for node in trace.gm.graph.nodes:
            if node.op != "call_function":
                if node.op != "placeholder":
                    steps.append(_Step(node, None))
                continue
            dev = self._device_of(trace, node.name, exact) if node.name in trace.ids else None
            steps.append(_Step(node, dev, _mutated_positions(node.target)))
        # a parameter lives where its first consumer runs
        homes = {ph: self._device_of(trace, op, exact) for ph, op in first_consumers(trace).items()}
        # free every value after its last use, so the interpreter holds no more than eager PyTorch would
        last: dict[str, int] = {}
        for i, s in enumerate(steps):
            for a in s.node.all_input_nodes:
                last[a.name] = i
        for name, i in last.items():
            steps[i].free.append(name)
        return steps, homes

    def _move_state(self, trace: _Trace, homes: Mapping[str, int]) -> None:
        placeholders = [n for n in trace.gm.graph.nodes if n.op == "placeholder"][:trace.n_state]
        _, state, _ = _state(self.module)
        with torch.no_grad():
            for ph, t in zip(placeholders, state, strict=True):
                d = homes.get(ph.name)
                if d is None:
                    continue
                dev = self.devices[d]
                if t.device != dev:
                    t.data = t.data.to(dev)
                    if t.grad is not None:
                        t.grad.data = t.grad.data.to(dev)

    # ----------------------------------------------------------------- running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, each op on its placed device; outputs stay where their last op ran."""
        trace, steps, homes, direct = self._trace_for(args, kwargs)
        leaves, _ = tree_flatten((tuple(args), dict(kwargs)))
        _, state, _ = _state(self.module)
        if direct:
            self.crossings = 0
            flat = trace.gm(state, [x for x in leaves if isinstance(x, torch.Tensor)])
            return tree_unflatten(flat, trace.out_spec)
        inputs = [*state, *(x for x in leaves if isinstance(x, torch.Tensor))]
        placeholders = [n for n in trace.gm.graph.nodes if n.op == "placeholder"]
        env: dict[str, Any] = {ph.name: x for ph, x in zip(placeholders, inputs, strict=True)}
        moved: dict[tuple[str, torch.device], torch.Tensor] = {}
        devices = self.devices
        # logical device of each value, to count crossings even when several logical devices share a real one
        logical: dict[str, int | None] = {ph.name: homes.get(ph.name) for ph in placeholders}
        crossed: set[tuple[str, int]] = set()

        def fetch(node: fx.Node, dev: torch.device | None, ldev: int | None = None) -> Any:
            val = env[node.name]
            src = logical.get(node.name)
            if ldev is not None and src is not None and src != ldev and isinstance(val, torch.Tensor):
                crossed.add((node.name, ldev))
            if dev is None or not isinstance(val, torch.Tensor) or val.device == dev:
                return val
            key = (node.name, dev)
            copy = moved.get(key)
            if copy is None:
                copy = val.to(dev)  # recorded by autograd: the gradient flows back to val's device
                moved[key] = copy
            return copy

        result: Any = None
        for s in steps:
            node = s.node
            if node.op == "get_attr":
                env[node.name] = getattr(trace.gm, node.target)  # type: ignore[arg-type]
            elif node.op == "output":
                result = fx.node.map_arg(node.args[0], lambda n: env[n.name])
            else:
                dev = self._run_device(s, env, devices)
                ldev = s.device
                if ldev is None:
                    ldev = next((logical.get(a.name) for a in node.all_input_nodes), None)
                logical[node.name] = ldev
                a = fx.node.map_arg(node.args, lambda n, d=dev, ld=s.device: fetch(n, d, ld))
                kw = fx.node.map_arg(node.kwargs, lambda n, d=dev, ld=s.device: fetch(n, d, ld))
                if dev is not None and "device" in kw and s.device is not None:
                    kw = {**kw, "device": dev}  # a factory op makes its tensor on its placed device
                env[node.name] = _call(node, dev, a, kw)
            for name in s.free:
                env.pop(name, None)
                logical.pop(name, None)
                for d in devices:
                    moved.pop((name, d), None)
        self.crossings = len(crossed)
        return tree_unflatten(result, trace.out_spec)

    def _run_device(self, s: _Step, env: Mapping[str, Any], devices: Sequence[torch.device]) -> torch.device | None:
        if s.device is not None:
            dev = devices[s.device]
            for i, name in s.mutates:
                arg = s.node.args[i] if i < len(s.node.args) else s.node.kwargs.get(name)
                if isinstance(arg, fx.Node):
                    val = env[arg.name]
                    if isinstance(val, torch.Tensor) and val.device != dev:
                        self.deviations += 1
                        return val.device  # mutate in place where the tensor lives (module docstring)
            return dev
        for a in s.node.all_input_nodes:
            val = env.get(a.name)
            if isinstance(val, torch.Tensor):
                return val.device
        return None


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def _call(node: fx.Node, dev: torch.device | None, args: Any, kwargs: Any) -> Any:
    target = node.target
    if dev is not None and dev.type != "cpu" and target is _CPU_FLASH:
        # the capture (on CPU) recorded the CPU-only fused attention kernel; elsewhere compute the same
        # attention with the portable math kernel (same values; it returns (out, weights), not (out, lse)),
        # laid out with the strides the traced CPU kernel's output had, which the traced views that follow
        # were decided for
        q, k, v = args[:3]
        dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
        is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, kwargs.get("attn_mask"), dropout_p, is_causal, scale=kwargs.get("scale"))
        val = node.meta.get("val")
        traced = val[0] if isinstance(val, tuple | list) and val else None
        if isinstance(traced, torch.Tensor) and tuple(traced.shape) == tuple(out.shape) \
                and tuple(traced.stride()) != tuple(out.stride()):
            out = out.new_empty_strided(tuple(out.shape), tuple(traced.stride())).copy_(out)
        return out, None
    if target in _VIEWS:
        try:
            return target(*args, **kwargs)
        except (RuntimeError, ValueError):
            # a kernel on another device laid its output out differently from the traced CPU one, so the
            # traced view no longer fits its strides: copy as reshape would (same values, not an alias)
            return torch.ops.aten.reshape.default(*args, **kwargs)
    return target(*args, **kwargs)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH = getattr(_CPU_FLASH, "default", None)


def apply_placement(model: nn.Module, graph: CompGraph, placement: Placement,
                    devices: Sequence[str | torch.device] | str, example_inputs: Any = None) -> PlacedModule:
    """`model` placed as `placement` (of `graph`, the model's captured training graph) on `devices` (one real
    device per logical device index). With `example_inputs` (as for `capture`) the forward is traced and the
    parameters moved now; otherwise on the first call."""
    placed = PlacedModule(model, graph, placement, devices)
    if example_inputs is not None:
        if isinstance(example_inputs, Mapping):
            placed.prepare(**example_inputs)
        elif isinstance(example_inputs, tuple | list):
            placed.prepare(*example_inputs)
        else:
            placed.prepare(example_inputs)
    return placed
