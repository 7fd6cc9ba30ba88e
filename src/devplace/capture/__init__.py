"""Capture: a model's training step (forward + backward + optimizer update) as a `CompGraph`.

`capture(model, example_inputs, *, loss_fn=None, optimizer="adam", name=None)` traces one step of a
PyTorch module on fake tensors (no real memory or compute) and returns the graph that docs/capture-format.md
describes; docs/capture.md says how it works and where its limits are.
"""

from devplace.capture.flops import FLOP_FORMULAS, conv_backward_flop, flop_counter_mode, op_flops
from devplace.capture.torch_capture import CaptureError, capture, default_loss

__all__ = ["FLOP_FORMULAS", "CaptureError", "capture", "conv_backward_flop", "default_loss", "flop_counter_mode",
           "op_flops"]
