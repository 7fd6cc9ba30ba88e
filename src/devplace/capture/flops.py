"""FLOP formulas of captured ops: PyTorch's registry (`torch.utils.flop_counter`) with corrections and additions.

1. `aten.convolution_backward`: PyTorch counts the weight-gradient term as if the convolution had one group,
   so a grouped convolution is over-counted by its `groups` (a depthwise 3x3 convolution of 960 channels by
   960x). Here each gradient is counted as what it is: a convolution of the same size as the forward one
   (grad_input is a transposed convolution of grad_output with the weight, grad_weight a convolution of the
   input with grad_output), so each requested output costs exactly the forward FLOPs,
   ``2 * N * C_out * (C_in / groups) * prod(kernel) * prod(out_spatial)`` (transposed: with the input's
   spatial size and the channel roles swapped).
2. Fused kernels that PyTorch leaves at 0 FLOPs get formulas of their own: the CPU attention kernel
   (`_scaled_dot_product_flash_attention_for_cpu` and its backward: the formulas of the other
   scaled-dot-product kernels) and the fused RNN layers that `nn.LSTM` runs (`mkldnn_rnn_layer` on the CPU,
   `_cudnn_rnn` on CUDA, and their backward): their matrix products, ``2 * tokens * (sum of the weight
   matrices' sizes)`` forward and twice that backward (input and weight gradients), gate nonlinearities
   not counted, like PyTorch's other formulas count only products.
3. Matrix products PyTorch has no formula for: the grouped products of mixture-of-experts layers
   (`_grouped_mm`, `_scaled_grouped_mm`: ``2 * M * K * N`` summed over the groups, see `grouped_mm_flop`),
   `addbmm` (``2 * b * n * m * p``, as `bmm`), `_addmm_activation` and `_int_mm` (as `mm`), `mv` / `addmv`
   (``2 * n * m``) and `dot` / `vdot` (``2 * n``). As in PyTorch's `addmm` and `baddbmm`, the added term
   is not counted.

`FLOP_FORMULAS` is the resulting table (`OpOverloadPacket -> formula(*args, out_val=..., **kwargs)`);
`flop_counter_mode()` is a `FlopCounterMode` that uses the same corrections, so captured FLOPs can be
compared with PyTorch's counter on equal terms. Torch's global registry is never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from inspect import unwrap
from math import prod
from typing import Any

import torch
from torch.utils import flop_counter as _fc

__all__ = ["FLOP_FORMULAS", "conv_backward_flop", "flop_counter_mode", "grouped_mm_flop", "op_flops"]

aten = torch.ops.aten


def conv_backward_flop(grad_out_shape: Sequence[int], x_shape: Sequence[int], w_shape: Sequence[int], _bias: Any,
                       _stride: Any, _padding: Any, _dilation: Any, transposed: bool, _output_padding: Any,
                       groups: int, output_mask: Sequence[bool], out_shape: Any = None, **_: Any) -> int:
    """FLOPs of `aten.convolution_backward` (shapes in, as `torch.utils.flop_counter` passes them).

    The weight shape already carries the grouping (`[C_out, C_in / groups, *kernel]`, transposed:
    `[C_in, C_out / groups, *kernel]`), so the forward formula of PyTorch, which is right for grouped
    convolutions, gives the cost of each gradient; the bias gradient (a reduction) is not counted, as in
    PyTorch. `groups` is named for clarity only: it is already in `w_shape`.
    """
    del groups
    forward = _fc.conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed=bool(transposed))
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _sdpa_cpu_flop(query_shape: Sequence[int], key_shape: Sequence[int], value_shape: Sequence[int], *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    return int(_fc.sdpa_flop_count(query_shape, key_shape, value_shape))


def _sdpa_cpu_backward_flop(grad_out_shape: Sequence[int], query_shape: Sequence[int], key_shape: Sequence[int],
                            value_shape: Sequence[int], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(_fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


def _rnn_flop(input_shape: Sequence[int], weight_shapes: Sequence[Sequence[int]]) -> int:
    tokens = prod(input_shape) // input_shape[-1] if input_shape and input_shape[-1] else 0
    return 2 * tokens * sum(prod(w) for w in weight_shapes if len(w) == 2)


def _mkldnn_rnn_layer_flop(input_shape: Sequence[int], w_ih: Sequence[int], w_hh: Sequence[int], *args: Any,
                           out_shape: Any = None, **kwargs: Any) -> int:
    return _rnn_flop(input_shape, [w_ih, w_hh])


def _mkldnn_rnn_layer_backward_flop(input_shape: Sequence[int], w_ih: Sequence[int], w_hh: Sequence[int],
                                    *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * _rnn_flop(input_shape, [w_ih, w_hh])


def _cudnn_rnn_flop(input_shape: Sequence[int], weights: Sequence[Sequence[int]], *args: Any, out_shape: Any = None,
                    **kwargs: Any) -> int:
    # `weights` holds every layer's and direction's matrices; a deeper layer reads the previous one's output,
    # which has as many tokens as the input, so the sum over matrices is the whole stack's work.
    return _rnn_flop(input_shape, weights)


def _cudnn_rnn_backward_flop(input_shape: Sequence[int], weights: Sequence[Sequence[int]], *args: Any,
                             out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * _rnn_flop(input_shape, weights)


def grouped_mm_flop(a_shape: Sequence[int], b_shape: Sequence[int], *args: Any, out_shape: Sequence[int],
                    **kwargs: Any) -> int:
    """FLOPs of `aten._grouped_mm` / `aten._scaled_grouped_mm` (`torch._grouped_mm(a, b, offs=...)`).

    Each group g is a product of an (M_g, K_g) and a (K_g, N_g) matrix, ``2 * M_g * K_g * N_g`` FLOPs. The
    group sizes are in `offs` (values, which a capture on fake tensors does not have), but their sum is a
    dimension of an operand, so the total is known from shapes alone, assuming every row is routed to a
    group (the offsets end at the last row: what a mixture-of-experts layer without dropped tokens does):

    - a 2-d (M, K_total), b 2-d (K_total, N), groups along K (a weight gradient): out (G, M, N),
      ``2 * M * K_total * N``;
    - otherwise the contraction size is K = a's last dimension and every output element is one
      K-long dot product: ``2 * numel(out) * K`` (2-d x 3-d, groups along M: out (M_total, N);
      3-d x 2-d, groups along N: out (M, N_total); 3-d x 3-d, a batched product: out (G, M, N)).
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * prod(out_shape) * a_shape[-1]


def _mv_flop(mat_shape: Sequence[int], _vec: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * mat_shape[0] * mat_shape[1]


def _addmv_flop(_self: Any, mat_shape: Sequence[int], _vec: Any, *args: Any, out_shape: Any = None,
                **kwargs: Any) -> int:
    return _mv_flop(mat_shape, _vec)


def _dot_flop(a_shape: Sequence[int], _b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * a_shape[0]


# The raw (shape-taking) overrides; FlopCounterMode's `custom_mapping` wraps them itself.
_OVERRIDES: dict[Any, Callable[..., int]] = {
    aten.convolution_backward: conv_backward_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
    aten.mkldnn_rnn_layer: _mkldnn_rnn_layer_flop,
    aten.mkldnn_rnn_layer_backward: _mkldnn_rnn_layer_backward_flop,
    aten._cudnn_rnn: _cudnn_rnn_flop,
    aten._cudnn_rnn_backward: _cudnn_rnn_backward_flop,
    aten._grouped_mm: grouped_mm_flop,
    aten._scaled_grouped_mm: grouped_mm_flop,
    # torch's own formulas for ops of the same shapes (unwrapped: these entries take shapes)
    aten.addbmm: unwrap(_fc.baddbmm_flop),  # baddbmm's products; the sum over the batch is not counted
    aten._addmm_activation: unwrap(_fc.addmm_flop),
    aten._int_mm: unwrap(_fc.mm_flop),
    aten.mv: _mv_flop,
    aten.addmv: _addmv_flop,
    aten.dot: _dot_flop,
    aten.vdot: _dot_flop,
}

FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **_fc.flop_registry,
    **{k: _fc.shape_wrapper(f) for k, f in _OVERRIDES.items()},
}


def flop_counter_mode(display: bool = False) -> _fc.FlopCounterMode:
    """A `torch.utils.flop_counter.FlopCounterMode` with devplace's corrections (module docstring)."""
    return _fc.FlopCounterMode(display=display, custom_mapping=dict(_OVERRIDES))


def op_flops(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one executed op call (0 for an op without a formula)."""
    formula = FLOP_FORMULAS.get(getattr(func, "_overloadpacket", None))
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))

