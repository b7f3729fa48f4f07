"""Composite ops built from the kernel launchers and cuBLASLt, each with a hand-written backward."""

from .mlp import MLPContext, mlp, mlp_backward, mlp_forward, mlp_grad, mlp_numpy, mlp_stack_bytes

__all__ = ["MLPContext", "mlp", "mlp_backward", "mlp_forward", "mlp_grad", "mlp_numpy", "mlp_stack_bytes"]
