"""Argument roles (equiv.roles): an argument the reference does not differentiate is a constant;
equiv neither makes it require grad nor aliases it with a differentiated argument, unless the
user's own ``inputs=`` did. ``constants=`` and per-argument ``variants=`` state roles by hand."""

from __future__ import annotations

import inspect

import hypothesis
import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import equiv
from equiv import equivalent_to
from equiv.roles import Roles
from equiv.strategies import tensors

REFUSED = "This input cannot have requires_grad True"


def run(impl, seed: int = 0, n: int = 40) -> equiv.Report:
    cfg = equiv.settings(seed=seed, max_examples=n, modes=("eager",),
                         hypothesis_settings=hypothesis.settings(database=None))
    return equiv.check(impl, settings=cfg, raise_on_failure=False)


def finding(report: equiv.Report, check: str) -> equiv.Finding:
    assert not report.ok, "not caught"
    f = next((f for f in report.findings if f.check == check), None)
    assert f is not None, report.render()
    return f


# -- a RoPE kernel: cos and sin are caches, never differentiated --------------------------------
def rotate(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate_adjoint(g):
    a, b = g.chunk(2, dim=-1)
    return torch.cat((b, -a), dim=-1)


def rope_ref(x, cos, sin):
    return x * cos.detach() + rotate(x) * sin.detach()


def rope_ref_plain(x, cos, sin):  # differentiates cos and sin: the roles cannot be derived
    return x * cos + rotate(x) * sin


def rope_function(sign: float) -> type[torch.autograd.Function]:
    """A fused RoPE: like an ATen kernel, it refuses grad-requiring caches; its backward
    returns None for them. ``sign=-1`` rotates the wrong way."""
    class Rope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, cos, sin):
            if cos.requires_grad or sin.requires_grad:
                raise RuntimeError(f"rope: cos and sin are not differentiable. {REFUSED}.")
            ctx.save_for_backward(cos, sin)
            return x * cos + sign * rotate(x) * sin

        @staticmethod
        def backward(ctx, g):
            cos, sin = ctx.saved_tensors
            return g * cos + sign * rotate_adjoint(g * sin), None, None

    return Rope


Rope, WrongSignRope = rope_function(1.0), rope_function(-1.0)


@st.composite
def rope_inputs(draw):
    """x requires grad, the caches do not: how a model calls RoPE."""
    n, d = draw(st.integers(1, 4)), 2 * draw(st.integers(1, 3))
    return (draw(tensors(shape=(n, d), requires_grad=True)),
            draw(tensors(shape=(n, d))), draw(tensors(shape=(n, d))))


def test_rope_caches_are_never_aliased_with_x():
    """The reference detaches cos and sin, so they are constants: no aliasing variant merges x
    with a cache into one grad-requiring base (which the kernel rightly refuses)."""
    @equivalent_to(rope_ref, inputs=rope_inputs())
    def rope(x, cos, sin):
        return Rope.apply(x, cos, sin)

    report = run(rope, 0, 60)
    assert report.ok, report.render()
    assert report.examples_run >= 40


def test_rope_with_a_wrong_rotation_sign_still_fails():
    @equivalent_to(rope_ref, inputs=rope_inputs())
    def rope(x, cos, sin):
        return WrongSignRope.apply(x, cos, sin)

    f = finding(run(rope), "forward")
    assert f.failure_class is equiv.OutputMismatch
    assert "refused" not in f.message and REFUSED not in f.message


def test_per_argument_variants_protect_the_caches():
    """A reference that differentiates cos and sin tells no roles; the user says them:
    ``constants=`` or per-argument ``variants=`` (layouts stay on for every argument)."""
    @equivalent_to(rope_ref_plain, inputs=rope_inputs(), constants=("cos", "sin"))
    def declared(x, cos, sin):
        return Rope.apply(x, cos, sin)

    @equivalent_to(rope_ref_plain, inputs=rope_inputs(),
                   variants={"cos": ("layouts",), "sin": ("layouts",)})
    def per_argument(x, cos, sin):
        return Rope.apply(x, cos, sin)

    assert per_argument.__equiv_spec__.variants == ("layouts", "aliasing")
    for impl in (declared, per_argument):
        report = run(impl, 0, 60)
        assert report.ok, report.render()


def test_the_users_own_aliasing_of_a_constant_is_respected():
    """An ``inputs=`` that passes x itself as cos is run as drawn: the kernel sees a cos that
    requires grad, refuses it, and that is reported."""
    seen = []

    @st.composite
    def same(draw):
        x = draw(tensors(shape=(2, 4), requires_grad=True))
        return (x, x, draw(tensors(shape=(2, 4))))

    @equivalent_to(rope_ref, inputs=same())
    def rope(x, cos, sin):
        seen.append(cos is x and cos.requires_grad)
        return Rope.apply(x, cos, sin)

    f = finding(run(rope, n=5), "error-parity")
    assert REFUSED in f.message
    assert seen and seen[0]  # the example's own call


# -- a weight ATen refuses to differentiate ----------------------------------------------------
def bce_ref(x, t, pw):
    log_weight = 1 + (pw.detach() - 1) * t
    return (1 - t) * x + log_weight * (torch.log1p(torch.exp(-x.abs())) + torch.relu(-x))


def test_a_weight_aten_refuses_to_differentiate_needs_no_option():
    """ATen's binary_cross_entropy_with_logits raises when pos_weight requires grad; the
    reference detaches it, so derived inputs draw it as a constant."""
    @equivalent_to(bce_ref)
    def bce(x: torch.Tensor, t: torch.Tensor, pw: torch.Tensor):
        return F.binary_cross_entropy_with_logits(x, t, pos_weight=pw, reduction="none")

    report = run(bce, 0, 40)
    assert report.ok, report.render()
    assert report.examples_run >= 40


@st.composite
def nll_inputs(draw):
    """log-probabilities requiring grad, class targets, and a class weight without
    requires_grad: how a training loop calls nll_loss."""
    n, c = draw(st.integers(1, 4)), draw(st.integers(2, 4))
    x = draw(tensors(shape=(n, c), requires_grad=True))
    target = torch.tensor(draw(st.lists(st.integers(0, c - 1), min_size=n, max_size=n)))
    return (x, target, draw(tensors(shape=(c,))).abs() + 0.5)


def nll_ref(x, target, w):  # differentiates w: the role comes from the example, not the ref
    picked = -x.gather(1, target[:, None])[:, 0] * w[target]
    return picked.sum() / w[target].sum()


def test_an_argument_given_without_requires_grad_is_never_aliased_into_a_grad_base():
    """ATen's nll_loss refuses a weight that requires grad; the user's inputs= give it none.
    No aliasing variant makes x and w views of one grad-requiring base (PyTorch's nll_loss
    against its Python reference was a false alarm this way)."""
    @equivalent_to(nll_ref, inputs=nll_inputs())
    def nll(x, target, w):
        return F.nll_loss(x, target, weight=w)

    report = run(nll, 0, 60)
    assert report.ok, report.render()
    assert report.examples_run >= 40


def scale_ref(x, w):
    return x * w


class DropsW(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w, None  # w's gradient silently dropped


def test_a_dropped_gradient_of_a_differentiated_argument_still_fails():
    """The reference differentiates w, so w is no constant: its missing gradient is caught."""
    @equivalent_to(scale_ref)
    def scale(x: torch.Tensor, w: torch.Tensor):
        return DropsW.apply(x, w)

    f = finding(run(scale), "gradients")
    assert f.failure_class is equiv.GradientMismatch
    assert f.argument == "w", f.message


def test_roles_are_derived_once_per_argument_signature():
    calls = []

    def ref(x, cos):
        calls.append(1)
        return x * cos.detach()

    roles = Roles(ref, inspect.signature(ref))
    x, cos = torch.ones(2, 3), torch.ones(2, 3)
    assert roles.constants({"x": x, "cos": cos}) == {"cos"}
    probes = len(calls)
    assert roles.constants({"x": x + 1, "cos": cos * 2}) == {"cos"}
    assert len(calls) == probes  # cached


# -- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    ({"constants": ("nope",)}, r"constants=\('nope',\).*\['nope'\] is not a parameter.*'cos'"),
    ({"constants": 3}, r"constants=3.*give a tuple of argument names"),
    ({"variants": {"nope": ()}}, r"variants=\{'nope': \.\.\.\}.*not a parameter"),
    ({"variants": {"cos": ("bogus",)}}, r"variants=\{'cos': \('bogus',\)\}.*from \("),
    ({"variants": {"cos": 3}}, r"variants=\{'cos': 3\}.*give True"),
])
def test_role_options_are_validated(options, match):
    with pytest.raises(equiv.InvalidArgument, match=match):
        equivalent_to(rope_ref, **options)(lambda x, cos, sin: x)


def test_old_variant_forms_still_work():
    for value, kinds in ((False, ()), (("layouts",), ("layouts",)), ("aliasing", ("aliasing",))):
        spec = equivalent_to(rope_ref, variants=value)(lambda x, cos, sin: x).__equiv_spec__
        assert spec.variants == kinds and dict(spec.argument_variants) == {}
    spec = equivalent_to(rope_ref, variants={"cos": False, "x": True},
                         constants="sin")(lambda x, cos, sin: x).__equiv_spec__
    assert dict(spec.argument_variants) == {"cos": (), "x": ("layouts", "aliasing",
                                                             "half-float32")}
    assert spec.constants == ("sin",)
