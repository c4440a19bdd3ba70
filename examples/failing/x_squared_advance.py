"""The x² lab's buggy kernel (docs/timeline.md): it advances x through ``.data`` after forward.

The write does not bump x's version counter, so autograd raises nothing and backward computes
the slope 2x from the advanced x: slope 4 where 2 is due at x=1. ``equiv check`` catches it and
the finding's timeline shows the untracked write between the save and the backward read.
"""

import torch

from equiv import equivalent_to


def square_ref(x):
    return x * x


@equivalent_to(square_ref, examples=[(torch.tensor([1.0], requires_grad=True),)])
def square_advance(x):
    y = x * x  # saves x for backward (slope 2x)
    x.data.add_(1.0)  # advance the lab to the next x, behind autograd's back
    return y
