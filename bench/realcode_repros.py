"""Reproductions, without equiv, of the discrepancies bench/realcode.py reported.

Each function prints what differs between the ATen kernel and the Python reference torch ships
(or, for the false alarms, the fact the finding rests on). ``python bench/realcode_repros.py``
runs them all; ``--only NAME`` one.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch._decomp as _decomp
import torch._refs as R
import torch._refs.nn.functional as RF
import torch.nn.functional as F

aten = torch.ops.aten


def group_norm_stride0_weight() -> None:
    """CPU native_group_norm reads a stride-0 weight as if contiguous (forward and backward);
    _refs.group_norm calls it directly, so here the *reference* is the wrong side."""
    x = torch.tensor([[[-0.5], [0.5]]], requires_grad=True)
    w = torch.tensor([-0.5]).expand(2)
    b = torch.tensor([-0.5, 0.5])
    bad = torch.native_group_norm(x, w, b, 1, 2, 1, 1, 1e-5)[0]
    good = torch.native_group_norm(x, w.contiguous(), b, 1, 2, 1, 1, 1e-5)[0]
    print("native_group_norm, w expanded  :", bad.flatten().tolist())
    print("native_group_norm, w contiguous:", good.flatten().tolist())
    print("F.group_norm,      w expanded  :", F.group_norm(x, 1, w, b).flatten().tolist())
    g = torch.tensor([[[1.0], [-2.0]]])
    gb, = torch.autograd.grad(bad, x, g)
    gg, = torch.autograd.grad(good, x, g)
    print("grad x: expanded", gb.flatten().tolist(), "contiguous", gg.flatten().tolist())


def group_norm_one_value_per_group() -> None:
    """F.group_norm raises on one value per group in training; torch.group_norm, _refs and the
    decomposition return (the normalized value is 0, the output the bias)."""
    x = torch.tensor([[[0.5]]])
    try:
        F.group_norm(x, 1)
    except ValueError as exc:
        print("F.group_norm raised:", exc)
    print("torch.group_norm:", torch.group_norm(x, 1).item(), " _refs:",
          RF.group_norm(x, 1).item())


def batch_norm_train_running_stats_grad() -> None:
    """The native_batch_norm decomposition, run eagerly under autograd, leaves the running
    stats it updates requiring grad (part of x's graph); the ATen kernel updates them as
    constants."""
    x = torch.randn(2, 1, 1, requires_grad=True)
    rm, rv = torch.zeros(1), torch.ones(1)
    F.batch_norm(x, rm, rv, training=True)
    print("F.batch_norm:   running_mean.requires_grad =", rm.requires_grad)
    rm2, rv2 = torch.zeros(1), torch.ones(1)
    _decomp.decomposition_table[aten.native_batch_norm.default](
        x, None, None, rm2, rv2, True, 0.1, 1e-5)
    print("decomposition:  running_mean.requires_grad =", rm2.requires_grad, rm2.grad_fn)


def batch_norm_eval_stride0_weight() -> None:
    """CPU eval-mode batch_norm backward with a stride-0 weight: grad x differs from the same
    values contiguous."""
    x = torch.tensor([[[-0.5], [0.5]], [[1.5], [-1.5]]], requires_grad=True)
    w = torch.tensor([-0.5]).expand(2)
    b, rm, rv = torch.tensor([-0.5, 0.5]), torch.tensor([-0.5, 0.5]), torch.ones(2)
    g = torch.tensor([[[1.0], [2.0]], [[-1.0], [0.5]]])
    for label, weight in (("expanded", w), ("contiguous", w.contiguous())):
        out = F.batch_norm(x, rm, rv, weight, b)
        gx, = torch.autograd.grad(out, x, g)
        print(f"eval batch_norm, w {label:10}: out", out.flatten().tolist(), "grad x",
              gx.flatten().tolist())


def constant_pad_nd_drops_grad() -> None:
    """_refs.constant_pad_nd's result does not reach x in autograd: its gradient is lost."""
    x = torch.tensor([[0.5]], requires_grad=True)
    ref = R.constant_pad_nd(x, (1, 2, 0, 1), 0.5)
    print("ref grad_fn:", ref.grad_fn, " grad x:",
          torch.autograd.grad(ref.sum(), x, allow_unused=True)[0])
    print("F.pad grad x:", torch.autograd.grad(F.pad(x, (1, 2, 0, 1), value=0.5).sum(), x)[0])


def vector_norm_stride0_accuracy() -> None:
    """CPU linalg.vector_norm of a stride-0 (expanded) float32 input is ~25 eps (relative) from
    float64; the same values contiguous are 1.6 eps away, _refs 0.2."""
    base = torch.tensor([-0.8652233481407166, -0.552222490310669, -0.31621962785720825])
    x = base.as_strided((3, 127), (1, 0))
    exact = torch.linalg.vector_norm(x.double()).item()
    for label, t in (("expanded", x), ("contiguous", x.contiguous()), ("_refs", None)):
        got = (R.linalg.vector_norm(x) if t is None else torch.linalg.vector_norm(t)).item()
        rel = abs(got - exact) / torch.finfo(torch.float32).eps / exact
        print(f"vector_norm {label:10}: {got:.9g}  (float64 {exact:.9g}, {rel:.1f} eps)")


def addcdiv_half_grad_overflow() -> None:
    """float16 addcdiv_ backward w.r.t. tensor2 overflows an intermediate (tensor1 / tensor2**2
    before the small grad multiplies it): -inf where the exact gradient is -147.2."""
    a, g = torch.tensor([1.1171875], dtype=torch.float16), torch.tensor([5e-4], dtype=torch.float16)
    got = []
    for f in (lambda x, b: x.addcdiv_(a, b, value=0.5), lambda x, b: R.addcdiv(x, a, b, value=0.5)):
        b = torch.tensor([0.001377105712890625], dtype=torch.float16, requires_grad=True)
        got.append(torch.autograd.grad(f(torch.zeros(1, dtype=torch.float16), b), b, g)[0].item())
    exact = -g.double() * 0.5 * a.double() / torch.tensor(0.001377105712890625).double() ** 2
    print(f"grad b: ATen {got[0]}, _refs {got[1]}, float64 {exact.item():.6g}")


def logsumexp_half_accuracy() -> None:
    """CPU float16 logsumexp rounds its sum in float16: log(1 + e^-5.07) comes out 103 float16
    ulps (6%) from float64, where _refs (and the same op on float32 values) is within 0.5."""
    x = torch.tensor([0.0, -5.07421875], dtype=torch.float16)
    exact = torch.logsumexp(x.double(), -1).item()
    for label, got in (("ATen float16", torch.logsumexp(x, -1)), ("_refs", R.logsumexp(x, -1)),
                       ("ATen on float32", torch.logsumexp(x.float(), -1).half())):
        ulp = torch.finfo(torch.float16).eps * 2.0 ** math.floor(math.log2(abs(exact)))
        print(f"logsumexp {label:16}: {got.item():.6g}  (float64 {exact:.6g}, "
              f"{abs(got.item() - exact) / ulp:.1f} ulps)")


def elu_inplace_half_grad() -> None:
    """float16 elu_ (in place) takes its backward from the rounded result: result + alpha
    cancels for x << 0, 12 float16 ulps from exp(x) at x = -4.36 where _refs (from x) is within
    1."""
    x0 = torch.tensor([-4.359375], dtype=torch.float16)
    leaf = x0.clone().requires_grad_()
    aten = torch.autograd.grad(F.elu_(leaf.clone()), leaf, torch.ones(1, dtype=torch.float16))[0]
    leaf = x0.clone().requires_grad_()
    ref = torch.autograd.grad(RF.elu(leaf), leaf, torch.ones(1, dtype=torch.float16))[0]
    exact = torch.exp(x0.double()).item()
    ulp = torch.finfo(torch.float16).eps * 2.0 ** math.floor(math.log2(exact))
    for label, got in (("ATen elu_", aten), ("_refs elu", ref)):
        print(f"grad {label}: {got.item():.6g} (float64 {exact:.6g}, "
              f"{abs(got.item() - exact) / ulp:.1f} ulps)")


# -- the facts behind the false alarms -----------------------------------------------------------

def constant_refuses_grad() -> None:
    """ATen refuses requires_grad on nll_loss's weight, BCE's weight and batch_norm's running
    stats; the aliasing variant made them (views of) a differentiated argument."""
    x = torch.randn(1, 2, requires_grad=True)
    try:
        F.nll_loss(x, torch.tensor([0]), x[0])
    except RuntimeError as exc:
        print("nll_loss with a grad-requiring weight:", str(exc).splitlines()[0])


def clamp_tie_lo_equals_hi() -> None:
    """clamp with lo == hi above x: ATen sends the gradient to neither bound, _refs.clamp to lo
    (two one-sided derivatives of a kink)."""
    x = torch.tensor([-0.5])
    lo, hi = torch.tensor([0.5], requires_grad=True), torch.tensor([0.5], requires_grad=True)
    print("ATen  grad (lo, hi):", torch.autograd.grad(x.clamp(lo, hi).sum(), (lo, hi)))
    lo2, hi2 = torch.tensor([0.5], requires_grad=True), torch.tensor([0.5], requires_grad=True)
    print("_refs grad (lo, hi):", torch.autograd.grad(R.clamp(x, lo2, hi2).sum(), (lo2, hi2)))


def kink_all_equal() -> None:
    """std of equal values and vector_norm(ord=3) of zeros are kinks: ATen's gradient is 0 (a
    subgradient of the convex function), _refs' is NaN."""
    for name, f, r, v in (("std", lambda t: torch.std(t, -1), lambda t: R.std(t, -1), -0.5),
                          ("norm3", lambda t: torch.linalg.vector_norm(t, 3, -1),
                           lambda t: R.linalg.vector_norm(t, 3, -1), 0.0)):
        x = torch.full((2,), v, requires_grad=True)
        print(name, "ATen", torch.autograd.grad(f(x), x)[0].tolist(), "_refs",
              torch.autograd.grad(r(x), x)[0].tolist())


def layer_norm_one_element() -> None:
    """layer_norm over one element: x - mean is one float32 rounding, times rstd = 1/sqrt(eps)
    ~ 316; ATen's gradients are that rounding, the decomposition's (float32 and float64) and
    ATen's in float64 are 0 up to float64 rounding."""
    ln = _decomp.decomposition_table[aten.native_layer_norm.default]
    fns = {"ATen": lambda x, w, b: F.layer_norm(x, (1,), w, b),
           "decomposition": lambda x, w, b: ln(x, (1,), w, b, 1e-5)[0]}
    for xv, wv, cot, wrt in ((3.0819921493530273, 0.5, 1.0, 1), (0.5, 3.0819921493530273, 0.7, 0)):
        for name, fn in fns.items():
            got = []
            for dtype in (torch.float32, torch.float64):
                x, w, b = (torch.tensor(v, dtype=dtype, requires_grad=True)
                           for v in ([[xv]], [wv], [0.5]))
                y = fn(x, w, b)
                got.append(torch.autograd.grad(y, (x, w)[wrt], torch.full_like(y, cot))[0].item())
            print(f"x={xv:.4g} w={wv:.4g} cotangent {cot}: grad {'xw'[wrt]} {name:13s} "
                  f"float32 {got[0]:.3g}, float64 {got[1]:.3g}")
    print(f"1 float32 ulp of x=3.08 times rstd: {torch.finfo(torch.float32).eps * 3.08 * 316:.3g}")


ALL = (group_norm_stride0_weight, group_norm_one_value_per_group,
       batch_norm_train_running_stats_grad, batch_norm_eval_stride0_weight,
       constant_pad_nd_drops_grad, vector_norm_stride0_accuracy, addcdiv_half_grad_overflow,
       logsumexp_half_accuracy, elu_inplace_half_grad,
       constant_refuses_grad,
       clamp_tie_lo_equals_hi, kink_all_equal, layer_norm_one_element)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", default=None, help="one function's name")
    a = p.parse_args(argv)
    for fn in ALL:
        if a.only in (None, fn.__name__):
            print(f"== {fn.__name__}: {' '.join(fn.__doc__.split())}")
            fn()


if __name__ == "__main__":
    main()
