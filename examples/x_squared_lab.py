"""The x² lab from the timeline doc (docs/timeline.md): the correct kernel.

Forward saves x because backward needs it for the slope 2x: x=1 gives slope 2, x=2 gives 4.
``square`` saves x with ``ctx.save_for_backward``, so a later in-place write to x makes autograd
raise instead of silently reading the new value (equiv's ``mutate-after-forward`` schedule accepts
that). The buggy twin, which advances x through ``.data`` after forward, is in
``examples/failing/x_squared_advance.py``.
"""

import torch

from equiv import equivalent_to


def square_ref(x):
    return x * x


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)  # versioned: a later write to x is detected
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@equivalent_to(square_ref, examples=[(torch.tensor([1.0], requires_grad=True),),
                                     (torch.tensor([2.0], requires_grad=True),)])
def square(x):
    return _Square.apply(x)
