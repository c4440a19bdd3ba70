"""The seed's ``q * (k + v)`` Function called with ``k`` in two slots.

Teaches: a backward that pre-aggregates the gradient of two aliased slots into one and returns
``None`` for the other is correct in eager — equiv gives each side one tensor object in both slots
and compares the accumulated gradient with the reference's. (Under ``torch.compile`` this very
pattern once silently lost a gradient; the modes guide shows equiv catching that.)
"""

import torch

from equiv import equivalent_to


class QKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask_v_grad: bool):
        ctx.save_for_backward(q, k, v)
        ctx.mask_v_grad = mask_v_grad
        return q * (k + v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        dq = dout * (k + v)
        dk = dout * q
        dv = dout * q
        if ctx.mask_v_grad:
            return dq, dk + dv, None, None  # pre-aggregated: only valid when k is v
        return dq, dk, dv, None


def attention_ref(q, k):
    return q * (k + k)


@equivalent_to(attention_ref)
def attention(q, k):
    return QKV.apply(q, k, k, True)
