"""Cost models: how long each op of a captured graph takes on a device (docs/cost-models.md).

Two models fill a graph's `compute_s`:

- **analytic** (roofline, Williams et al. 2009): an op of class c takes
  ``max(flops / (peak_flops * efficiency[c]), bytes / (mem_bandwidth_Bps * bw_efficiency[c])) + launch_overhead_s``
  where `flops` and `bytes` are the node's `flops` and `mem_access_bytes` (docs/capture-format.md) and the
  class comes from the ATen op name (`op_class`); optimizer ops pay one launch per `tensors_per_launch`
  tensors they update (multi-tensor kernels). Ops that launch no kernel (views, allocation, graph inputs: class `view`)
  take `view_s`: 0 on a GPU, the dispatch cost on a CPU. Parameters: `GPU_ROOFLINE`, `CPU_ROOFLINE`.
  `peak_flops` depends on the op's precision (`peak_flops_for`): a matrix product (gemm, convolution,
  attention) in fp32, TF32, bf16 or fp16 gets the device's peak for that class (`Device.peak_flops_*`).
- **profiled**: a `CostTable` (`devplace.costs/1`) of median measured seconds keyed by the node's signature
  (`signature_key(node["sig"])`), written by `devplace.capture.profile.profile_graph`; nodes whose signature
  is missing from the table fall back to the analytic model, and the report says how many did. A table also
  carries the `Overheads` measured on its machine (`devplace profile`): the per-op overhead of a real step,
  which `apply_costs` adds to every op that is not a view, and the pipelining runtime's cost per action and
  per transfer, which `apply_overheads` puts on a cluster's devices and links.

A node that makes parameter gradients also gets what adding them into `.grad` costs on a micro-batch after the
first (`accumulate_s`, per kind `accumulate_s_by_kind`: each add, `aten.add_.Tensor` on the gradient's shape,
costed as any op by the same model, table or roofline; `devplace.graph.phases`, "gradient accumulation"), and
what dividing them by M costs once a step (`scale_s`, `scale_s_by_kind`: `aten.div_.Tensor` by a number, as
Python calls it).

Units. The simulator runs an op for ``compute_s / speed`` on a device (DESIGN.md section 4), so
`compute_s` is "seconds on a device of speed 1.0" (a V100 SXM2 with the presets). A cost model gives
``t_device``, the op's seconds on one concrete device; `apply_costs` stores
``compute_s = t_device * device.speed``, which gives back exactly ``t_device`` on that device and scales the
time by the speed ratio (peak-FLOP/s ratio with the presets) on any other.

This module is pure data and arithmetic (no torch): `hardware/` sits below `capture/`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from devplace.errors import DevplaceError, FormatError
from devplace.graph.compgraph import KIND_COMPUTE_KEY, CompGraph
from devplace.graph.jsonio import check_format, dump_number, read_json, write_json
from devplace.graph.phases import (
    ACCUMULATE_BY_KIND_KEY,
    ACCUMULATE_KEY,
    ACCUMULATES_KEY,
    SCALE_BY_KIND_KEY,
    SCALE_KEY,
)
from devplace.hardware.cluster import Cluster, Device, Link

__all__ = [
    "CPU_ROOFLINE", "FORMAT", "GPU_ROOFLINE", "MATRIX_CLASSES", "OP_CLASSES", "TF32_DEFAULTS", "ClassRow",
    "CostError", "CostReport", "CostTable", "Overheads", "Roofline", "analytic_node_time", "apply_costs",
    "apply_overheads", "check_table_fits", "dtype_class",
    "node_signatures", "node_traffic_bytes", "op_class", "op_name", "peak_flops_for", "roofline_for", "roofline_time",
    "sig_tensor_count", "signature_key",
]

FORMAT = "devplace.costs/1"


class CostError(DevplaceError):
    """A cost model cannot cost a graph for a device (missing device figures, table of another device)."""


def signature_key(sig: Mapping[str, Any]) -> str:
    """The canonical JSON of an op signature (sorted keys, no spaces): the key of a cost table entry."""
    return json.dumps(sig, sort_keys=True, separators=(",", ":"), allow_nan=False)


# ================================================================================== op classes
OP_CLASSES = ("gemm", "convolution", "attention", "elementwise", "reduction", "embedding", "optimizer", "copy",
              "view", "other")

_GEMM = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot", "vdot",
         "_addmm_activation", "_scaled_mm", "_int_mm", "tensordot", "einsum", "_weight_int8pack_mm",
         "_weight_int4pack_mm", "linear_backward", "mkldnn_linear", "mkldnn_linear_backward"}
_CONV_RE = re.compile(r"^_?(convolution|conv\d?d|conv_transpose\d?d?|conv_tbc|cudnn_convolution|mkldnn_convolution"
                      r"|miopen_convolution|miopen_depthwise_convolution|slow_conv|thnn_conv|_slow_conv|conv_depthwise"
                      r"|_conv_depthwise|_nnpack_spatial_convolution|cudnn_convolution_transpose|_convolution)")
_EMBEDDING = {"embedding", "embedding_dense_backward", "embedding_backward", "embedding_sparse_backward",
              "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only", "_embedding_bag_backward",
              "_embedding_bag_dense_backward", "_embedding_bag_per_sample_weights_backward", "embedding_renorm",
              "index_select", "index_select_backward", "gather", "gather_backward", "scatter", "scatter_add",
              "scatter_reduce", "index", "_unsafe_index", "index_put", "_unsafe_index_put", "_index_put_impl",
              "index_add", "index_copy", "index_fill", "index_reduce", "masked_select", "masked_scatter", "take",
              "put", "_unsafe_masked_index", "_unsafe_masked_index_put_accumulate"}
_REDUCTION = {"sum", "mean", "prod", "amax", "amin", "max", "min", "aminmax", "argmax", "argmin", "var", "std",
              "var_mean", "std_mean", "norm", "linalg_vector_norm", "frobenius_norm", "nansum", "nanmean",
              "logsumexp", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "any", "all",
              "count_nonzero", "topk", "sort", "argsort", "kthvalue", "median", "mode", "nonzero",
              "native_layer_norm", "layer_norm", "native_batch_norm", "batch_norm", "_native_batch_norm_legit",
              "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "_batch_norm_impl_index",
              "cudnn_batch_norm", "miopen_batch_norm", "batch_norm_stats", "batch_norm_elemt",
              "batch_norm_gather_stats", "batch_norm_gather_stats_with_counts", "batch_norm_backward_reduce",
              "batch_norm_backward_elemt", "_batch_norm_with_update", "_batch_norm_no_update",
              "batch_norm_update_stats",
              "native_group_norm", "group_norm", "instance_norm", "rms_norm", "_fused_rms_norm", "softmax",
              "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "_softmax_backward_data",
              "_log_softmax_backward_data", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward",
              "nll_loss_nd", "cross_entropy_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
              "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "cosine_similarity",
              "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
              "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
              "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
              "adaptive_max_pool2d", "adaptive_max_pool3d", "mkldnn_max_pool2d", "_cdist_forward", "cdist",
              "weight_norm", "_weight_norm_interface", "renorm", "histc", "bincount", "unique", "_unique2",
              "unique_consecutive", "_to_sparse", "segment_reduce", "_segment_reduce", "ctc_loss", "_ctc_loss",
              "_fused_moving_avg_obs_fq_helper", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell"}
_OPTIMIZER_PREFIXES = ("_foreach_", "_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad")
_COPY = {"copy", "_copy_from", "_copy_from_and_resize", "_to_copy", "to", "clone", "contiguous", "cat", "_cat",
         "concat", "concatenate", "stack", "hstack", "vstack", "constant_pad_nd", "pad", "reflection_pad1d",
         "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
         "repeat", "repeat_interleave", "tile", "flip", "roll", "rot90", "fill", "zero", "zeros", "zeros_like",
         "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full", "scalar_tensor", "arange",
         "linspace", "logspace", "eye", "lift_fresh_copy", "convert_element_type", "device_put", "upsample_nearest1d",
         "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
         "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
         "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "grid_sampler_2d",
         "grid_sampler", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle",
         "im2col", "col2im", "unfold_backward", "tril", "triu", "to_dense", "_to_dense", "_pdist_forward",
         "diag_embed", "diag", "_nested_tensor_from_tensor_list", "alias_copy", "resize", "_resize_output"}
_VIEW = {"view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "expand_as",
         "slice", "select", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "split", "split_with_sizes",
         "unbind", "chunk", "tensor_split", "narrow", "diagonal", "unfold", "view_as", "flatten", "unflatten",
         "movedim", "moveaxis", "swapaxes", "swapdims", "real", "imag", "view_as_real", "view_as_complex",
         "_neg_view", "_conj", "conj", "resolve_conj", "resolve_neg", "lift_fresh", "lift", "empty", "empty_like",
         "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "sym_size", "sym_stride", "sym_numel",
         "sym_storage_offset", "_assert_async", "_assert_scalar", "_assert_tensor_metadata", "_local_scalar_dense",
         "set", "_make_dep_token", "sym_constrain_range", "sym_constrain_range_for_size", "_functional_assert_async",
         "_fw_primal", "_make_dual", "_unpack_dual", "numpy_T", "mT", "mH", "adjoint", "align_as", "rename",
         "input", "placeholder", "output", "getitem", "_pin_memory", "record_stream"}
_ELEMENTWISE = {
    "add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "neg", "abs", "exp", "exp2", "expm1", "log",
    "log2", "log10", "log1p", "sqrt", "rsqrt", "pow", "square", "reciprocal", "relu", "relu6", "gelu", "silu",
    "mish", "sigmoid", "tanh", "hardtanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "selu", "celu",
    "softplus", "softshrink", "hardshrink", "threshold", "prelu", "_prelu_kernel", "rrelu_with_noise", "glu",
    "logit", "where", "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum", "fmax", "fmin", "eq", "ne",
    "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_not", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "sin", "cos", "tan", "asin", "acos",
    "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "floor", "ceil", "round",
    "trunc", "frac", "sign", "sgn", "signbit", "addcdiv", "addcmul", "lerp", "native_dropout", "dropout",
    "bernoulli", "rand_like", "randn_like", "randint_like", "rand", "randn", "randint", "uniform", "normal",
    "exponential", "random", "nan_to_num", "fmod", "remainder", "hypot", "isnan", "isinf", "isfinite",
    "isposinf", "isneginf", "xlogy", "special_xlog1py", "lgamma", "digamma", "polygamma", "i0", "sinc", "heaviside",
    "copysign", "nextafter", "ldexp", "masked_fill", "fill_diagonal", "_masked_scale", "_fused_dropout",
    "native_dropout_backward", "threshold_backward", "gelu_backward", "silu_backward", "mish_backward",
    "sigmoid_backward", "tanh_backward", "hardtanh_backward", "hardswish_backward", "hardsigmoid_backward",
    "leaky_relu_backward", "elu_backward", "softplus_backward", "logit_backward", "glu_backward",
    "clamp_backward", "pow_backward", "polar", "complex", "angle", "conj_physical", "positive", "deg2rad",
    "rad2deg", "float_power", "logaddexp", "logaddexp2",
}
_DROP_SUFFIXES = ("_backward_data", "_backward_input", "_backward_weight", "_double_backward", "_backward",
                  "_forward", "_out", "_functional", "_default")


def op_name(op: str) -> str:
    """The ATen op of a node's `op`: `aten.convolution.default` -> `convolution`, `aten::add_` -> `add_`."""
    text = op.replace("::", ".")
    parts = text.split(".")
    if len(parts) >= 2:
        return parts[1]
    return parts[0]


def _lookup(name: str) -> str | None:
    if name in _VIEW:
        return "view"
    if name.startswith(_OPTIMIZER_PREFIXES):
        return "optimizer"
    if "attention" in name or name.startswith(("_flash_", "_efficient_attention", "_cudnn_attention")):
        return "attention"
    if name in _GEMM:
        return "gemm"
    if _CONV_RE.match(name):
        return "convolution"
    if name in _EMBEDDING:
        return "embedding"
    if name in _REDUCTION:
        return "reduction"
    if name in _COPY:
        return "copy"
    if name in _ELEMENTWISE:
        return "elementwise"
    return None


def op_class(op: str, kind: str = "") -> str:
    """The cost class of an ATen op name (one of OP_CLASSES).

    In-place variants (`add_`) are their op; backward ops without an entry of their own take their forward
    op's class (`native_layer_norm_backward` -> reduction); `*_copy` view variants and `*_scatter` are
    `copy`. An elementwise, copy or unknown op of a node of kind `optimizer` (`addcdiv_` of an unfused Adam)
    is reported as `optimizer`. Unknown ops are `other`.
    """
    name = op_name(op)
    base = name.rstrip("_") or name  # in-place variants: add_ -> add, _foreach_add_ -> _foreach_add
    candidates = [base]
    for suffix in _DROP_SUFFIXES:
        if base.endswith(suffix) and len(base) > len(suffix):
            candidates.append(base[: -len(suffix)])
    candidates += [c.lstrip("_") for c in candidates if c.startswith("_")]
    cls = next((c for c in map(_lookup, candidates) if c is not None), None)
    if cls == "view" and _lookup(base) != "view":
        cls = "copy"  # the backward of a view (select_backward, slice_backward) writes a new tensor
    if cls is None:
        if base.endswith("_copy") or base.endswith("_scatter"):
            cls = "copy"
        elif base.startswith(("foreach_", "_foreach_")):
            cls = "optimizer"
        else:
            cls = "other"
    if kind == "optimizer" and cls in ("elementwise", "copy", "other"):
        return "optimizer"
    return cls


# ================================================================================== analytic roofline
@dataclass(frozen=True)
class Roofline:
    """Parameters of the analytic model: per op class the fraction of `peak_flops` (`efficiency`) and of
    `mem_bandwidth_Bps` (`bw_efficiency`) an op of that class reaches, and a fixed per-op overhead."""

    name: str
    efficiency: Mapping[str, float]
    bw_efficiency: Mapping[str, float]
    launch_overhead_s: float
    view_s: float = 0.0  # time of an op of class `view` (no kernel): 0 on a GPU, the dispatch cost on a CPU
    tensors_per_launch: int = 1  # optimizer ops pay launch_overhead_s once per this many tensors they update

    def __post_init__(self) -> None:
        for table in (self.efficiency, self.bw_efficiency):
            missing = [c for c in OP_CLASSES if c != "view" and c not in table]
            if missing:
                raise ValueError(f"roofline {self.name!r}: no efficiency for op class(es) {missing}")
            bad = {c: e for c, e in table.items() if not 0 < e <= 1}
            if bad:
                raise ValueError(f"roofline {self.name!r}: efficiencies must be in (0, 1], got {bad}")
        if self.launch_overhead_s < 0 or self.view_s < 0 or self.tensors_per_launch < 1:
            raise ValueError(f"roofline {self.name!r}: need launch_overhead_s >= 0, view_s >= 0, "
                             "tensors_per_launch >= 1")


# Engineering estimates for GPUs whose `peak_flops` is the dense FP16/BF16 tensor-core peak (the presets'
# convention) and `mem_bandwidth_Bps` the datasheet HBM bandwidth. Reasoning: docs/cost-models.md.
GPU_ROOFLINE = Roofline(
    name="gpu",
    efficiency={"gemm": 0.6, "convolution": 0.45, "attention": 0.45, "elementwise": 0.1, "reduction": 0.1,
                "embedding": 0.1, "optimizer": 0.1, "copy": 0.1, "other": 0.3},
    bw_efficiency={"gemm": 0.8, "convolution": 0.7, "attention": 0.7, "elementwise": 0.8, "reduction": 0.6,
                   "embedding": 0.4, "optimizer": 0.7, "copy": 0.7, "other": 0.5},
    launch_overhead_s=5e-6,
    view_s=0.0,
    tensors_per_launch=36,
)

# For a CPU described by *measured* figures (`devplace.capture.profile.local_cpu_device`: peak_flops = the best
# float32 FLOP/s of a matmul or a convolution, mem_bandwidth_Bps = a large copy's bytes/s). Set from the
# calibration in docs/cost-models.md, on one machine: relative to those measured figures, not to a datasheet.
CPU_ROOFLINE = Roofline(
    name="cpu",
    efficiency={"gemm": 0.9, "convolution": 1.0, "attention": 0.5, "elementwise": 0.05, "reduction": 0.05,
                "embedding": 0.05, "optimizer": 0.05, "copy": 0.05, "other": 0.2},
    bw_efficiency={"gemm": 1.0, "convolution": 0.2, "attention": 0.8, "elementwise": 1.0, "reduction": 0.6,
                   "embedding": 1.0, "optimizer": 1.0, "copy": 1.0, "other": 0.5},
    launch_overhead_s=3e-6,
    view_s=1e-6,
    tensors_per_launch=1,
)


def roofline_for(device: Device) -> Roofline:
    """`CPU_ROOFLINE` for a device whose kind starts with "cpu", else `GPU_ROOFLINE`."""
    return CPU_ROOFLINE if device.kind.lower().startswith("cpu") else GPU_ROOFLINE


# ================================================================================== precision
# Op classes whose FLOPs are matrix products: they run at the peak of their precision (tensor cores for
# bf16/fp16/TF32 where the device has them). The other classes have no FLOPs counted (the FLOP registry
# counts products only), so their time is the memory term and their compute term keeps `peak_flops`.
MATRIX_CLASSES = ("gemm", "convolution", "attention")
# PyTorch's defaults: fp32 matmuls on the CUDA cores (torch.backends.cuda.matmul.allow_tf32 = False, i.e.
# float32_matmul_precision "highest"), fp32 convolutions on TF32 tensor cores (torch.backends.cudnn.allow_tf32
# = True). A capture records the flags it ran under in meta.capture.tf32; those win.
TF32_DEFAULTS: Mapping[str, bool] = {"matmul": False, "convolution": True}
_DTYPE_CLASSES = {"float32": "fp32", "fp32": "fp32", "float64": "fp32", "complex64": "fp32", "complex128": "fp32",
                  "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}


def dtype_class(dtype: str) -> str:
    """The precision class of a dtype name ("float32" or "fp32" -> "fp32", "bfloat16" -> "bf16", "float16" ->
    "fp16"), "" for integer, boolean, fp8 and unknown dtypes. float64 and complex are costed as fp32 (on
    V100, A100 and H100, FP64 runs at half the FP32 rate, so such ops come out up to 2x too fast)."""
    return _DTYPE_CLASSES.get(dtype, "")


def peak_flops_for(device: Device, cls: str, dtype: str = "", tf32: Mapping[str, bool] | None = None) -> float:
    """The peak FLOP/s an op of class `cls` computing in `dtype` gets on `device`.

    A matrix product (`MATRIX_CLASSES`) in bf16 or fp16 gets the device's `peak_flops_bf16` / `_fp16`; in fp32
    `peak_flops_tf32` if TF32 is allowed for it (`tf32["convolution"]` for convolutions, `tf32["matmul"]` for
    gemm and attention; default `TF32_DEFAULTS`), else `peak_flops_fp32`. Everything else, and a peak the
    device leaves at 0 (unknown), gets `peak_flops`.
    """
    if cls not in MATRIX_CLASSES:
        return device.peak_flops
    klass = dtype_class(dtype)
    if klass == "fp32":
        flags = TF32_DEFAULTS if tf32 is None else tf32
        if flags.get("convolution" if cls == "convolution" else "matmul", False):
            klass = "tf32"
    peak = getattr(device, f"peak_flops_{klass}") if klass else 0.0
    return peak or device.peak_flops


def _check_device(device: Device) -> None:
    if not (device.peak_flops > 0 and device.mem_bandwidth_Bps > 0):
        raise CostError(
            f"device {device.name!r} ({device.kind or 'no kind'}) has no peak_flops and/or mem_bandwidth_Bps; the "
            "analytic cost model needs both: use a preset cluster (devplace clusters), add them to the cluster "
            "file, or describe this machine's CPU with devplace.capture.profile.local_cpu_device()"
        )


def roofline_time(flops: float, mem_bytes: float, cls: str, device: Device, roofline: Roofline | None = None,
                  tensors: int = 1, dtype: str = "", tf32: Mapping[str, bool] | None = None) -> float:
    """Seconds an op of class `cls` computing in `dtype` with `flops` and `mem_bytes` of traffic takes on `device`.

    ``max(flops / (peak * efficiency[cls]), mem_bytes / (mem_bandwidth_Bps * bw_efficiency[cls]))``
    with ``peak = peak_flops_for(device, cls, dtype, tf32)``,
    plus the launch overhead: once for most ops; for an `optimizer` op over `tensors` tensors,
    ``tensors / roofline.tensors_per_launch`` of it (multi-tensor kernels launch once per that many tensors,
    and a one-tensor update of a per-parameter optimizer step stands for its share of such a launch, as
    PyTorch runs Adam and SGD on GPUs with `foreach` kernels by default). A `view` takes `roofline.view_s`.
    """
    rl = roofline or roofline_for(device)
    if cls == "view":
        return rl.view_s
    _check_device(device)
    compute = flops / (peak_flops_for(device, cls, dtype, tf32) * rl.efficiency[cls])
    memory = mem_bytes / (device.mem_bandwidth_Bps * rl.bw_efficiency[cls])
    launches = max(tensors, 1) / rl.tensors_per_launch if cls == "optimizer" else 1.0
    return max(compute, memory) + launches * rl.launch_overhead_s


_GATHER_FORWARD = {"embedding", "index_select", "gather", "index", "_unsafe_index", "take", "embedding_bag",
                   "_embedding_bag", "_embedding_bag_forward_only"}


def _extra_number(rec: Mapping[str, Any], key: str) -> float:
    val = rec.get(key, 0)
    if isinstance(val, bool) or not isinstance(val, int | float) or not math.isfinite(val) or val < 0:
        raise CostError(f"node {rec.get('id')!r}: \"{key}\" must be a finite number >= 0, got {val!r}")
    return float(val)


def node_traffic_bytes(rec: Mapping[str, Any]) -> float:
    """Bytes an op moves: its `mem_access_bytes` (inputs + outputs), except that a gather (`embedding`,
    `index_select`, `gather`, `index`) reads only the rows it returns, not its whole table:
    min(mem_access_bytes, 2 * output_bytes) when its output size is known."""
    traffic = _extra_number(rec, "mem_access_bytes")
    name = op_name(str(rec.get("op", "")))
    out = _extra_number(rec, "output_bytes")
    if name.rstrip("_") in _GATHER_FORWARD and out > 0:
        traffic = min(traffic, 2 * out)
    return traffic


def sig_tensor_count(sig: Any) -> int:
    """Tensors an op works on, from its signature: the length of its first tensor-list argument (the
    parameters of a `_foreach_*` or `_fused_adam_` op), else 1."""
    if isinstance(sig, Mapping) and isinstance(sig.get("args"), list):
        for a in sig["args"]:
            if isinstance(a, list) and a and all(isinstance(x, Mapping) and "tensor" in x for x in a):
                return len(a)
    return 1


def analytic_node_time(rec: Mapping[str, Any], device: Device, roofline: Roofline | None = None, *,
                       tf32: Mapping[str, bool] | None = None, default_dtype: str = "") -> float:
    """Seconds the node record `rec` (a `devplace.graph/1` node with `flops`, `mem_access_bytes` and
    optionally `sig` and `dtype`) takes on `device` under the roofline model; a node without `dtype` computes
    in `default_dtype` ("" = unknown: `device.peak_flops`)."""
    cls = op_class(str(rec.get("op", "")), str(rec.get("kind", "")))
    tensors = sig_tensor_count(rec.get("sig")) if cls == "optimizer" else 1
    return roofline_time(_extra_number(rec, "flops"), node_traffic_bytes(rec), cls, device, roofline, tensors,
                         str(rec.get("dtype", default_dtype)), tf32)


# ================================================================================== gradient accumulation
ACCUMULATE_OP = "aten.add_.Tensor"  # what AccumulateGrad runs for a later micro-batch's gradient: .grad += g
SCALE_OP = "aten.div_.Tensor"  # what torch's pipelining runs once a step on a mean loss's gradients: .grad /= M
# (signature key of the entry, op, traffic in gradient sizes): an add reads two and writes one, a division one each
_GRAD_OPS = {ACCUMULATE_KEY: ("sig", ACCUMULATE_OP, 3), SCALE_KEY: ("scale_sig", SCALE_OP, 2)}


def _accumulates(rec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The node's gradient accumulation adds (`graph.phases.ACCUMULATES_KEY`, written by the capture), checked."""
    accs = rec.get(ACCUMULATES_KEY, [])
    if not isinstance(accs, list) or not all(isinstance(a, Mapping) for a in accs):
        raise CostError(f"node {rec.get('id')!r}: \"{ACCUMULATES_KEY}\" must be a list of objects with the add's "
                        f"\"sig\", the division's \"scale_sig\" and the gradient's \"bytes\", got {accs!r:.200}; "
                        "capture the model again")
    return accs


def node_signatures(extra: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The signatures a node's costs are looked up by in a cost table: its op's, then those of the adds of its
    gradients into `.grad` on later micro-batches and of their division by M (what profiling times, so that
    those are measured too)."""
    sig = extra.get("sig")
    accs = extra.get(ACCUMULATES_KEY)
    out = [sig] if isinstance(sig, Mapping) else []
    if isinstance(accs, list):
        out += [a[k] for a in accs if isinstance(a, Mapping) for k in ("sig", "scale_sig")
                if isinstance(a.get(k), Mapping)]
    return out


def _grad_op_time(rec: Mapping[str, Any], key: str, device: Device, how: tuple[Roofline, CostTable | None],
                  tf32: Mapping[str, bool], op_s: float) -> float:
    """Seconds on `device` of one pass of the node's gradient ops of `key` (`_GRAD_OPS`: the adds into `.grad` of
    one later micro-batch, or the once-a-step division by M): each costed as any op, its signature's time in the
    table where measured, else the roofline of an elementwise in-place op moving that many gradient sizes, plus the
    per-op overhead `op_s` (0 where the table does not apply)."""
    which, op, sizes = _GRAD_OPS[key]
    total = 0.0
    for a in _accumulates(rec):
        nbytes = _extra_number({**a, "id": rec.get("id")}, "bytes")
        one = {"id": rec.get("id"), "op": op, "kind": "backward", "mem_access_bytes": sizes * nbytes,
               "sig": a.get(which)}
        total += _time_on(one, device, how, tf32, None) + op_s
    return total


# ================================================================================== cost tables
def _time_on(rec: Mapping[str, Any], device: Device, how: tuple[Roofline, CostTable | None],
             tf32: Mapping[str, bool], dtype: str | None) -> float:
    """A node's seconds on `device`: the table's measurement where it has one, else the roofline."""
    rl, table = how
    t = table.lookup(rec.get("sig")) if table is not None else None
    return t if t is not None else analytic_node_time(rec, device, rl, tf32=tf32, default_dtype=dtype or "")


def _device_dict(d: Device) -> dict[str, Any]:
    return {f.name: (dump_number(getattr(d, f.name)) if isinstance(getattr(d, f.name), float) else getattr(d, f.name))
            for f in fields(Device)}


def _device_from(doc: Any, where: str) -> Device:
    if not isinstance(doc, Mapping):
        raise FormatError(f"{where}: \"device\" must be an object with the fields of a cluster device")
    known = {f.name for f in fields(Device)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise FormatError(f"{where}: \"device\" has unknown key(s) {unknown}; known: {sorted(known)}")
    try:
        given = {f.name: (str(doc[f.name]) if f.type in (str, "str") else float(doc[f.name]))
                 for f in fields(Device) if f.name in doc}
        return Device(**{"name": "", "memory_bytes": 0.0, **given})
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{where}: \"device\": {exc}") from None


@dataclass(frozen=True)
class Overheads:
    """What a real training step costs beyond its ops' own (profiled) times, measured on one machine
    (`devplace profile`, `devplace.runtime.overheads`); 0 = not measured.

    `op_s`: per op of the step (the dispatcher, autograd's bookkeeping, Python between kernels), added by
    `apply_costs` to every op that is not a view. `action_s`: per action of a pipelined step (one stage's
    forward or backward of one micro-batch), the pipelining runtime's own work; `transfer_latency_s`: per
    tensor sent between two stage processes. `apply_overheads` puts these two on a cluster (`Device.action_s`,
    the links' `latency_s`), where the simulator charges them."""

    op_s: float = 0.0
    action_s: float = 0.0
    transfer_latency_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {f.name: dump_number(getattr(self, f.name)) for f in fields(Overheads)}

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> Overheads:
        """Read the table's "overheads" object: known keys only, each a finite number of seconds >= 0."""
        names = [f.name for f in fields(Overheads)]
        if not isinstance(doc, Mapping) or set(doc) - set(names):
            raise FormatError(f"{where}: \"overheads\" must be an object with (some of) {', '.join(names)}, got "
                              f"{doc!r}; profile again")
        out = {}
        for k, v in doc.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 <= v <= 1e3:
                raise FormatError(f"{where}: overheads.{k} must be a number of seconds in 0..1000, got {v!r}")
            out[k] = float(v)
        return cls(**out)


@dataclass
class CostTable:
    """Measured op times on one device kind: signature key -> median seconds (`devplace.costs/1`).

    `skipped` lists the signatures that could not be run, with the reason; `device` is the measured
    device's description when known (`speed`, `peak_flops`, `mem_bandwidth_Bps`), so the table can be
    applied and calibrated on its own; `overheads` what a real step costs beyond its ops (`Overheads`);
    `meta` keeps any other top-level keys (threads, timer, ...).
    """

    device_kind: str
    entries: dict[str, float] = field(default_factory=dict)
    torch: str = ""
    warmup: int = 0
    repeats: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    device: Device | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    overheads: Overheads = field(default_factory=Overheads)

    def lookup(self, sig: Mapping[str, Any] | None) -> float | None:
        """The median seconds measured for this signature, or None."""
        if not isinstance(sig, Mapping):
            return None
        return self.entries.get(signature_key(sig))

    def __len__(self) -> int:
        return len(self.entries)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"format": FORMAT, "device_kind": self.device_kind, "torch": self.torch,
                               "warmup": self.warmup, "repeats": self.repeats}
        if self.device is not None:
            doc["device"] = _device_dict(self.device)
        doc.update(self.meta)
        doc["overheads"] = self.overheads.to_dict()
        doc["entries"] = {k: self.entries[k] for k in sorted(self.entries)}
        doc["skipped"] = {k: self.skipped[k] for k in sorted(self.skipped)}
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str = "cost table") -> CostTable:
        check_format(doc, FORMAT, where)
        kind = doc.get("device_kind")
        if not isinstance(kind, str):
            raise FormatError(f"{where}: needs a string \"device_kind\" (the device the times were measured on)")
        entries = doc.get("entries", {})
        if not isinstance(entries, Mapping):
            raise FormatError(f"{where}: \"entries\" must be an object of signature key -> seconds")
        clean: dict[str, float] = {}
        for k, v in entries.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise FormatError(f"{where}: entry {k[:80]!r}...: seconds must be a finite number >= 0, got {v!r}")
            clean[k] = float(v)
        skipped = doc.get("skipped", {})
        if not isinstance(skipped, Mapping) or not all(isinstance(v, str) for v in skipped.values()):
            raise FormatError(f"{where}: \"skipped\" must be an object of signature key -> reason")
        ints = {}
        for k in ("warmup", "repeats"):
            v = doc.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise FormatError(f"{where}: \"{k}\" must be an integer >= 0, got {v!r}")
            ints[k] = v
        torch_version = doc.get("torch", "")
        if not isinstance(torch_version, str):
            raise FormatError(f"{where}: \"torch\" must be a version string")
        device = _device_from(doc["device"], where) if "device" in doc else None
        overheads = Overheads.from_dict(doc["overheads"], where) if "overheads" in doc else Overheads()
        meta = {k: v for k, v in doc.items() if k not in ("format", "device_kind", "torch", "warmup", "repeats",
                                                          "device", "entries", "skipped", "overheads")}
        return cls(device_kind=kind, entries=clean, torch=torch_version, warmup=ints["warmup"],
                   repeats=ints["repeats"], skipped=dict(skipped), device=device, meta=meta, overheads=overheads)

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_dict(read_json(path, FORMAT), str(path))


# ================================================================================== applying a model
@dataclass(frozen=True)
class ClassRow:
    """One op class of a cost report: number of nodes, their total seconds on the device, share of the total."""

    count: int
    total_s: float
    share: float


@dataclass(frozen=True)
class CostReport:
    """What `apply_costs` did: per op class, node count and device seconds; and the table's coverage."""

    model: str  # "analytic" or "profiled"
    device: Device
    rows: dict[str, ClassRow]
    total_s: float  # sum over nodes of the time on `device` (not a step time: no overlap, no communication)
    nodes: int
    profiled_nodes: int = 0  # nodes whose time came from the cost table
    analytic_nodes: int = 0  # nodes costed analytically (all of them with model="analytic")
    profiled_share: float = 0.0  # share of total_s that was measured
    op_overhead_s: float = 0.0  # the table's per-op overhead, included in total_s (`Overheads.op_s`)

    @property
    def coverage(self) -> float:
        """Fraction of nodes whose time was measured (1.0 means the table covered the whole graph)."""
        return self.profiled_nodes / self.nodes if self.nodes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "device": _device_dict(self.device), "total_s": self.total_s,
                "op_overhead_s": self.op_overhead_s,
                "nodes": self.nodes, "profiled_nodes": self.profiled_nodes, "analytic_nodes": self.analytic_nodes,
                "coverage": self.coverage, "profiled_share": self.profiled_share,
                "classes": {c: {"count": r.count, "total_s": r.total_s, "share": r.share}
                            for c, r in self.rows.items()}}

    def format(self) -> str:
        """A plain-text table (what `devplace capture` prints)."""
        dev = self.device.kind or self.device.name
        lines = [f"cost model: {self.model} on {dev} (speed {self.device.speed:.4g}); sum of op times "
                 f"{self.total_s * 1e3:.3f} ms over {self.nodes} ops"]
        if self.model == "profiled":
            lines.append(f"profiled: {self.profiled_nodes}/{self.nodes} ops ({self.coverage:.1%}), "
                         f"{self.profiled_share:.1%} of the time; the rest analytic"
                         + (f"; every op but views {self.op_overhead_s * 1e6:.1f} us more (measured per-op overhead)"
                            if self.op_overhead_s else ""))
        lines.append(f"{'op class':<12} {'ops':>7} {'time (ms)':>12} {'share':>7}")
        for c, r in sorted(self.rows.items(), key=lambda kv: (-kv[1].total_s, kv[0])):
            lines.append(f"{c:<12} {r.count:>7} {r.total_s * 1e3:>12.3f} {r.share:>7.1%}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def cost_devices(cluster: Cluster) -> tuple[Device, tuple[Device, ...]]:
    """(the device a graph placed on `cluster` is costed for, the devices of every kind it is costed for as
    well). A cluster of one kind: its first device, and nothing more (compute_s / speed is then exact). Several
    kinds: one device of each kind, by kind name, the first of them the reference -- so that the costs, and with
    them every placement, do not depend on the order in which a cluster file lists its devices."""
    by_kind: dict[str, Device] = {}
    for d in cluster.devices:
        if d.kind:
            by_kind.setdefault(d.kind, d)
    if len(by_kind) <= 1:
        return cluster.devices[0], ()
    kinds = tuple(by_kind[k] for k in sorted(by_kind))
    return kinds[0], kinds


def apply_costs(graph: CompGraph, device: Device, model: str | CostTable = "analytic", *,
                roofline: Roofline | None = None, dtype: str | None = None,
                kinds: Sequence[Device] = ()) -> tuple[CompGraph, CostReport]:
    """A copy of `graph` whose nodes' `compute_s` is their time on `device` in speed-1.0 units, and a report.

    Each node's time t on `device` comes from the cost table (by `signature_key(node["sig"])`) when `model`
    is a `CostTable` that has it, else from the roofline (`analytic_node_time`). The node gets
    ``compute_s = t * device.speed``, so the simulator's ``compute_s / speed`` gives back t on this device.
    The graph's meta gains `"cost": {"model", "device_kind", "speed", "profiled_nodes", "nodes", "tf32"}`.

    Precision: each node's matrix FLOPs run at the device's peak for the node's `dtype` (`peak_flops_for`);
    `dtype` ("fp32", "bf16", "fp16" or a torch dtype name) is assumed for nodes that have none (graphs from
    ONNX, JSON files or older captures; None: `device.peak_flops`). TF32 use follows the capture's
    `meta.capture.tf32` flags, else PyTorch's defaults (`TF32_DEFAULTS`).

    `kinds`: devices of other kinds the step may run on (`cost_devices`); each node also gets its time on each
    of them (`compute_s_by_kind`, from the table where it was measured on that kind, else the roofline with that
    kind's peak for the node's dtype), which the simulator and the placers use for devices of those kinds.

    A table's per-op overhead (`table.overheads.op_s`, measured by `devplace profile`) is added to the time of
    every op that is not a view (class `view`: graph inputs and views launch nothing), measured or analytic, on
    the table's device kind; so on one device a step of n such ops is simulated n x op_s longer.

    Raises CostError when the device lacks peak_flops/mem_bandwidth_Bps for an op that needs the analytic
    model, or when the table was measured on another device kind than `device.kind`.
    """
    if not device.speed > 0:
        raise CostError(f"device {device.name!r}: speed must be > 0 to express times in speed-1.0 units")
    table: CostTable | None
    if isinstance(model, CostTable):
        table = model
        if table.device_kind and device.kind and table.device_kind != device.kind:
            raise CostError(f"the cost table was measured on {table.device_kind!r} but the device is "
                            f"{device.kind!r}; profile on that device, or cost with model=\"analytic\"")
    elif model == "analytic":
        table = None
    else:
        raise CostError(f"unknown cost model {model!r}; use \"analytic\" or a CostTable (devplace profile)")
    rl = roofline or roofline_for(device)
    if dtype is not None and not dtype_class(dtype):
        raise CostError(f"unknown dtype {dtype!r} for nodes without one; use fp32, bf16 or fp16")
    captured = graph.meta.get("capture")
    flags = captured.get("tf32") if isinstance(captured, Mapping) else None
    tf32 = {k: bool(flags.get(k, v)) for k, v in TF32_DEFAULTS.items()} if isinstance(flags, Mapping) \
        else dict(TF32_DEFAULTS)

    kind_tables = {k.kind: (roofline_for(k), table if table is not None and table.device_kind == k.kind else None)
                   for k in kinds}
    op_s = table.overheads.op_s if table is not None else 0.0
    nodes = []
    per_class: dict[str, list[float]] = {}
    profiled = 0
    profiled_s = 0.0
    for v in range(graph.num_nodes):
        rec = graph.node_record(v)
        cls = op_class(graph.op[v], graph.kind[v])
        t = table.lookup(rec.get("sig")) if table is not None else None
        if t is not None:
            profiled += 1
            profiled_s += t
        else:
            t = analytic_node_time(rec, device, rl, tf32=tf32, default_dtype=dtype or "")
        extra = op_s if cls != "view" else 0.0
        t += extra
        rec["compute_s"] = dump_number(t * device.speed)
        if kinds:
            rec[KIND_COMPUTE_KEY] = {k.kind: dump_number(_time_on(rec, k, kind_tables[k.kind], tf32, dtype)
                                                         + (extra if kind_tables[k.kind][1] is not None else 0.0))
                                     for k in kinds}
        if ACCUMULATES_KEY in rec:  # what its gradients' adds into .grad and their division by M cost
            for key, kinds_key in ((ACCUMULATE_KEY, ACCUMULATE_BY_KIND_KEY), (SCALE_KEY, SCALE_BY_KIND_KEY)):
                rec[key] = dump_number(_grad_op_time(rec, key, device, (rl, table), tf32, op_s) * device.speed)
                if kinds:
                    rec[kinds_key] = {
                        k.kind: dump_number(_grad_op_time(rec, key, k, kind_tables[k.kind], tf32,
                                                          op_s if kind_tables[k.kind][1] is not None else 0.0))
                        for k in kinds}
        nodes.append(rec)
        acc = per_class.setdefault(cls, [0, 0.0])
        acc[0] += 1
        acc[1] += t
    total = sum(a[1] for a in per_class.values())
    rows = {c: ClassRow(count=int(a[0]), total_s=a[1], share=a[1] / total if total > 0 else 0.0)
            for c, a in sorted(per_class.items())}
    name = "analytic" if table is None else "profiled"
    report = CostReport(model=name, device=device, rows=rows, total_s=total, nodes=graph.num_nodes,
                        profiled_nodes=profiled, analytic_nodes=graph.num_nodes - profiled,
                        profiled_share=profiled_s / total if total > 0 else 0.0, op_overhead_s=op_s)
    meta = dict(graph.meta)
    meta["cost"] = {"model": name, "device_kind": device.kind, "speed": dump_number(device.speed),
                    "profiled_nodes": profiled, "nodes": graph.num_nodes, "tf32": tf32}
    if op_s:
        meta["cost"]["op_overhead_s"] = dump_number(op_s)
    if kinds:
        meta["cost"]["kinds"] = [k.kind for k in kinds]
    edges = [graph.edge_record(e) for e in range(graph.num_edges)]
    return CompGraph.build(graph.name, nodes, edges, meta), report


def check_table_fits(cluster: Cluster, table: CostTable) -> None:
    """CostError, before any capture, when `table` was measured on another device kind than the one a graph
    placed on `cluster` is costed for (`cost_devices`; what `apply_costs` would refuse later)."""
    device, _ = cost_devices(cluster)
    if table.device_kind and device.kind and table.device_kind != device.kind:
        raise CostError(f"the cost table was measured on {table.device_kind!r}, but cluster {cluster.name!r} is "
                        f"costed for {device.kind!r}; give a cluster of {table.device_kind!r} devices (a cluster "
                        "file whose devices have that \"kind\"), or profile on the cluster's device kind")


def apply_overheads(cluster: Cluster, table: CostTable) -> Cluster:
    """`cluster` with the pipelining overheads `table` measured (`Overheads`) on its devices of the table's
    kind: each gets `action_s` (the simulator charges it per action of a pipelined step), and every link
    between two of them the measured `transfer_latency_s` as its `latency_s` (where measured, > 0; the
    bandwidth stays). Devices of other kinds and their links are unchanged; so is a cluster when the table
    measured neither. The per-op overhead is the cost model's (`apply_costs`), not the cluster's."""
    o = table.overheads
    mine = [i for i, d in enumerate(cluster.devices) if d.kind == table.device_kind]
    if not (o.action_s or o.transfer_latency_s) or not mine:
        return cluster
    devices = tuple(replace(d, action_s=o.action_s) if i in mine and o.action_s else d
                    for i, d in enumerate(cluster.devices))
    links = dict(cluster.links)
    if o.transfer_latency_s:
        for a in mine:
            for b in mine:
                if a != b:
                    links[(a, b)] = Link(cluster.pair(a, b).bandwidth_Bps, o.transfer_latency_s)
    return Cluster(cluster.name, devices, cluster.link, links, cluster.meta)
