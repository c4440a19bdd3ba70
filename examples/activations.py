"""In-place activations checked against their pure references.

Teaches: declaring an in-place kernel with ``mutates={"x": "out"}`` (the reference's whole result
is x's final value, and the returned tensor may alias ``x``), and a custom Function that writes
its input in place, marks it dirty and saves its *output* for backward.
"""

import torch

import equiv
from equiv import equivalent_to


def relu_ref(x):
    return torch.relu(x)


@equivalent_to(relu_ref, mutates={"x": "out"})
def relu_(x):
    return x.clamp_(min=0)


def leaky_relu_ref(x, negative_slope: float = 0.01):
    return torch.where(x > 0, x, x * negative_slope)


@equivalent_to(leaky_relu_ref, mutates={"x": "out"})
def leaky_relu_(x, negative_slope: float = 0.01):
    return torch.nn.functional.leaky_relu_(x, negative_slope)


class SiLUInPlace(torch.autograd.Function):
    """y = x * sigmoid(x) written into x. Backward needs only s = sigmoid(x) and y:
    dy/dx = s * (1 + x * (1 - s)) = s + y * (1 - s)."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        x.mul_(s)
        ctx.mark_dirty(x)
        ctx.save_for_backward(s, x)  # x now holds the output y
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable  # s was saved without history: double backward
    def backward(ctx, grad):                      # through it would be silently wrong, so say so
        s, y = ctx.saved_tensors
        return grad * (s + y * (1 - s))


def silu_ref(x):
    return x * torch.sigmoid(x)


# torch 2.13's aot_eager returns a wrong gradient for this (correct) Function: equiv reports it
# as a compile-only divergence (see docs/modes.md), so the shipped example runs in eager only.
@equivalent_to(silu_ref, mutates={"x": "out"}, settings=equiv.settings(modes=("eager",)))
def silu_(x):
    return SiLUInPlace.apply(x)
