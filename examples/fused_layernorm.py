"""A fused LayerNorm module (one pass for mean and variance, a hand-written backward) against
``torch.nn.LayerNorm``.

Teaches: registering an ``nn.Module`` pair with ``@equivalent_to(nn.LayerNorm, init=...)``; the
parameters (``params['weight']``, ``params['bias']``) are drawn and compared by their gradients,
the input is fitted to the module with ``input_shapes=(..., 16)`` (any leading dims, last dim 16).
"""

import torch
from torch import nn

import equiv
from equiv import equivalent_to

FEATURES = 16


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        mean = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        xhat = (x - mean) * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        return xhat * weight + bias

    @staticmethod
    @torch.autograd.function.once_differentiable  # saves intermediates: first order only
    def backward(ctx, g):
        xhat, rstd, weight = ctx.saved_tensors
        lead = tuple(range(g.dim() - 1))          # every dim but the normalized one
        gw, gb = (g * xhat).sum(lead) if lead else g * xhat, g.sum(lead) if lead else g
        gx = g * weight
        gx = rstd * (gx - gx.mean(-1, keepdim=True) - xhat * (gx * xhat).mean(-1, keepdim=True))
        return gx, gw, gb, None


@equivalent_to(nn.LayerNorm, init=dict(normalized_shape=FEATURES, dtype=torch.float64),
               input_shapes=(..., FEATURES), settings=equiv.settings(max_examples=30))
class FusedLayerNorm(nn.Module):
    def __init__(self, normalized_shape: int, eps: float = 1e-5, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(normalized_shape, dtype=dtype))

    def forward(self, input):
        return _LayerNormFn.apply(input, self.weight, self.bias, self.eps)
