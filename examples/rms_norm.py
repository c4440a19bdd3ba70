"""A fused RMSNorm with a hand-written backward that recomputes ``rstd`` instead of saving it.

Teaches: checking a memory-saving backward (fewer saved tensors, more arithmetic) against the
plain formula, gradients for random cotangents w.r.t. both ``x`` and ``weight``, and a repeated
backward through the retained graph.
"""

import hypothesis.strategies as st
import torch

from equiv import equivalent_to
from equiv.strategies import tensors

EPS = 1e-6


def rms_norm_ref(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


class RMSNormRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        ctx.save_for_backward(x, weight)  # rstd is recomputed in backward
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        gw = grad * weight
        dx = rstd * gw - x * rstd.pow(3) * (gw * x).mean(-1, keepdim=True)
        dweight = (grad * x * rstd).reshape(-1, x.shape[-1]).sum(0)
        return dx, dweight


def _inputs():
    def build(shape):
        rows, cols = shape
        return st.tuples(
            tensors(shape=(rows, cols), dtype=torch.float64, requires_grad=True),
            tensors(shape=(cols,), dtype=torch.float64, requires_grad=True, salt=1),
        )

    sides = st.tuples(st.integers(1, 4), st.integers(1, 8))
    return sides.flatmap(build)


@equivalent_to(rms_norm_ref, inputs=_inputs())
def rms_norm(x, weight):
    return RMSNormRecompute.apply(x, weight)
