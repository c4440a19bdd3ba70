"""An in-place Adam step (PyTorch's own foreach kernel) against a functional update.

Teaches: several mutated arguments, ``mutates={"param": 0, "exp_avg": 1, "exp_avg_sq": 2}``
where the reference returns the three new values and the implementation returns nothing; the
gradient argument must stay bitwise unchanged.
"""

import hypothesis.strategies as st
import torch
from torch.optim.adam import adam as adam_functional

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.0


def adam_ref(param, grad, exp_avg, exp_avg_sq, step: int):
    b1, b2 = BETAS
    m = b1 * exp_avg + (1 - b1) * grad
    v = b2 * exp_avg_sq + (1 - b2) * grad * grad
    m_hat = m / (1 - b1**step)
    v_hat = v / (1 - b2**step)
    return param - LR * m_hat / (v_hat.sqrt() + EPS), m, v


def _inputs():
    def build(shape):
        t = lambda salt: tensors(shape=shape, dtype=torch.float64, salt=salt)
        return st.tuples(t(0), t(1), t(2), t(3).map(torch.abs), st.integers(1, 5))

    return st.lists(st.integers(1, 5), min_size=1, max_size=2).map(tuple).flatmap(build)


# torch 2.13 cannot trace the foreach kernel with a tensor step ("Expected scalars to be on CPU,
# got meta instead"): equiv reports that under compile[aot_eager], so this example runs in eager.
@equivalent_to(adam_ref, mutates={"param": 0, "exp_avg": 1, "exp_avg_sq": 2}, inputs=_inputs(),
               rtol=1e-9, atol=1e-12, settings=equiv.settings(modes=("eager",)))
def adam_(param, grad, exp_avg, exp_avg_sq, step: int):
    adam_functional([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step - 1))],  # the kernel increments it
                    foreach=True, amsgrad=False, beta1=BETAS[0], beta2=BETAS[1], lr=LR,
                    weight_decay=WD, eps=EPS, maximize=False)
