"""In-place activations checked against their pure references.

``relu_`` writes its result into ``x`` and returns ``x``: the contract declares it with
``mutates={"x": "out"}`` (the reference's whole result is x's final value), which also allows the
returned tensor to alias ``x``.
"""

import torch

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
