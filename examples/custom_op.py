"""``torch.library`` custom ops: a functional op whose kernel writes into a buffer it allocates,
with a registered autograd formula, and a mutating op declared with ``mutates_args``.

Teaches: equiv checks a custom op against a reference formula (``torch.library.opcheck`` compares
the op only with itself), and a mutating op with ``mutates={"x": "out"}``.
"""

import hypothesis.strategies as st
import torch

from equiv import equivalent_to
from equiv.strategies import scalars, tensors


@torch.library.custom_op("equiv_examples::softplus", mutates_args=())
def softplus_op(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.exp(x, out=out)  # in-place arithmetic on a private buffer
    out.log1p_()  # log1p, not add_(1).log_(): 1 + exp(x) rounds away exp(x)'s digits in float16
    return out


@softplus_op.register_fake
def _(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * torch.sigmoid(x)


torch.library.register_autograd("equiv_examples::softplus", _backward, setup_context=_setup)


def softplus_ref(x):
    return torch.log1p(torch.exp(x))


@equivalent_to(softplus_ref)
def softplus(x):
    return softplus_op(x)


@torch.library.custom_op("equiv_examples::scale_", mutates_args=("x",))
def scale_op_(x: torch.Tensor, alpha: float) -> None:
    x.mul_(alpha)


def scale_ref(x, alpha):
    return x * alpha


@equivalent_to(scale_ref, mutates={"x": "out"},
               inputs=st.tuples(tensors(shape=(3, 2), dtype=torch.float64),
                                scalars(float, -2, 2)))  # compile modes: 3 values, see modes.md
def scale_(x, alpha):
    scale_op_(x, alpha)
