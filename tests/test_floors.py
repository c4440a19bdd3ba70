"""Floors and suspects: the forward's and the gradients' term-magnitude floor (rounding of
cancelling terms passes),
half-precision outputs judged by the baseline rule with a floor in ULPs, and findings that name
the reference as the suspect when it returns other values for equal inputs or depends on its
arguments' layout."""

from __future__ import annotations

import math

import hypothesis
import pytest
import torch
from hypothesis import strategies as st

import equiv
from equiv import check, equivalent_to
from equiv.execution.rounding import rounding_spread

F64 = torch.float64


def _cfg(seed: int = 0, n: int = 15) -> equiv.settings:
    return equiv.settings(max_examples=n, seed=seed, modes=("eager",),
                          hypothesis_settings=hypothesis.settings(database=None))


def _offset_rows(width: int):
    """(x, weight, bias): rows of ``width`` values around a large common offset (``x - mean``
    cancels), a weight and a bias."""
    def build(seed: int, offset: float, noise: float) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(16, 1, generator=g, dtype=F64).sign() * offset
        x = base + noise * torch.randn(16, width, generator=g, dtype=F64)
        return x.float(), torch.randn(width, generator=g), torch.randn(width, generator=g)

    return st.builds(build, st.integers(0, 2 ** 20), st.sampled_from([1.0, 100.0, 1000.0]),
                     st.sampled_from([1.0, 1e-3]))


# -- forward cancellation at float32 rounding ------------------------------------------------
def _layer_norm_ref(x, w, b):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b)


def _fused_layer_norm(x, w, b, eps=1e-5, centre=True):
    """layer_norm as a fused kernel computes it: ``x * s + (b - mean * s)``, two terms of size
    ``|x| * s`` that cancel (``s = w / sqrt(var + eps)``)."""
    mean = x.mean(-1, keepdim=True)
    s = torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps) * w
    return x * s + (b - mean * s) if centre else x * s + b


def _ln_specs(width):
    @equivalent_to(_layer_norm_ref, inputs=_offset_rows(width))
    def fused(x, w, b):
        return _fused_layer_norm(x, w, b)

    @equivalent_to(_layer_norm_ref, inputs=_offset_rows(width))
    def wrong_eps(x, w, b):
        return _fused_layer_norm(x, w, b, eps=1e-2)

    @equivalent_to(_layer_norm_ref, inputs=_offset_rows(width))
    def no_mean(x, w, b):
        return _fused_layer_norm(x, w, b, centre=False)

    return fused, wrong_eps, no_mean


def test_a_fused_layer_norm_over_one_or_two_elements_passes_at_float32_rounding():
    """``x * s - mean * s`` keeps the rounding of terms of size ``|x| / sqrt(eps)`` where the
    float64 result is 0 (one element) or small: the floor is the rounding spread of the
    reference's intermediates (its float64 run with each op's result perturbed)."""
    for width in (1, 2):
        fused, _, _ = _ln_specs(width)
        report = check(fused, settings=_cfg(), checks=("forward",), raise_on_failure=False)
        assert report.ok, report.render()


def test_a_layer_norm_with_the_wrong_epsilon_or_no_mean_still_fails_the_forward():
    _, wrong_eps, no_mean = _ln_specs(2)
    for spec in (wrong_eps, no_mean):
        report = check(spec, settings=_cfg(), checks=("forward",), raise_on_failure=False)
        assert not report.ok
        f = report.findings[0]
        assert f.check == "forward" and f.headline == "output differs from the reference."
        assert "vs float64" in f.details


def test_the_rounding_spread_sees_the_terms_a_group_of_one_cancels():
    """A group of one element: the float64 result is exactly the bias, but its intermediates
    (the mean, ``x * s``) round at ``|x| / sqrt(eps)``; a NumPy-free pure function of values
    with no arithmetic has no spread."""
    x, w, b = torch.full((3, 1), 1000.0, dtype=F64), torch.ones(1, dtype=F64), torch.ones(1, dtype=F64)
    run = lambda: {"y": _fused_layer_norm(x, w, b)}  # noqa: E731
    spread = rounding_spread(run, run(), seed=0)["y"]
    eps32 = torch.finfo(torch.float32).eps
    assert (spread > 1000.0 * 316 * eps32 * 0.1).all()  # the size of x * rsqrt(eps) * eps
    copy = lambda: {"y": x.clone()}  # noqa: E731
    assert float(rounding_spread(copy, copy(), seed=0)["y"].max()) == 0.0


# -- gradient cancellation at float32 rounding -----------------------------------------------
_LN_DECOMP = torch._decomp.decomposition_table[torch.ops.aten.native_layer_norm.default]


def _decomp_layer_norm(x, w, b):
    return _LN_DECOMP(x, x.shape[-1:], w, b, 1e-5)[0]


def _aten_layer_norm(x, w, b):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b)


class _LayerNorm(torch.autograd.Function):
    """layer_norm with an explicit backward; ``bug``: ``"w*1.01"`` (the weight's gradient 1%
    off), ``"unbiased"`` (the backward recomputes rstd from the unbiased variance) or
    ``"no mean"`` (the input's gradient drops the mean of ``g * w``)."""

    @staticmethod
    def forward(ctx, x, w, b, bug):
        mean = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.var(-1, keepdim=True, correction=0) + 1e-5)
        ctx.save_for_backward(x, w)
        ctx.bug = bug
        return (x - mean) * rstd * w + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        var = x.var(-1, keepdim=True, correction=1 if ctx.bug == "unbiased" else 0)
        rstd = torch.rsqrt(var + 1e-5)
        xhat = (x - x.mean(-1, keepdim=True)) * rstd
        gw = (g * xhat).sum(0) * (1.01 if ctx.bug == "w*1.01" else 1.0)
        gxhat = g * w
        centred = gxhat if ctx.bug == "no mean" else gxhat - gxhat.mean(-1, keepdim=True)
        gx = rstd * (centred - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        return gx, gw, g.sum(0), None


#: one-element rows where ATen's float32 backward rounds ``x - mean`` (|x| ~ 3) and multiplies
#: it by rstd = 1/sqrt(eps): grad w -2.7e-05 for cotangent 1 where float64 gives 0
_ONE_ELEMENT = st.sampled_from([(3.0819921493530273, 0.5), (0.5, 3.0819921493530273)]).map(
    lambda xw: (torch.tensor([[xw[0]]], requires_grad=True),
                torch.tensor([xw[1]], requires_grad=True), torch.tensor([0.5], requires_grad=True)))


def _rows(width: int, offset: float = 0.0):
    """(x, w, b): 8 rows of ``width`` values around ``offset``, a weight and a bias."""
    def build(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        x = (offset + torch.randn(8, width, generator=g, dtype=F64)).float()
        return tuple(t.requires_grad_() for t in (x, torch.randn(width, generator=g),
                                                  torch.randn(width, generator=g)))

    return st.builds(build, st.integers(0, 2 ** 20))


def _grad_checks(spec, n: int = 10):
    return check(spec, settings=_cfg(n=n), checks=("gradients", "repeated-backward"),
                 raise_on_failure=False)


def test_a_perturbed_vjp_rounds_the_backwards_own_ops():
    """The backward runs under the perturbing mode: a Function exact in its forward (a clone)
    whose backward multiplies has a spread; its forward alone perturbed leaves the VJP exact."""
    class Triple(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 3.0

    x = torch.full((4,), 1.5, dtype=F64, requires_grad=True)

    def vjp():
        return {"x": torch.autograd.grad(Triple.apply(x), x, torch.ones(4, dtype=F64))[0]}

    spread = rounding_spread(vjp, vjp(), seed=0)["x"]
    eps32 = torch.finfo(torch.float32).eps
    assert (spread > 0.1 * 3.0 * eps32).all() and (spread < 3.0 * eps32).all()
    y = Triple.apply(x)  # the forward with no arithmetic: nothing to perturb
    assert rounding_spread(lambda: {"y": Triple.apply(x)}, {"y": y}, seed=0)["y"].max() == 0


def test_the_gradient_spread_sees_the_cancellation_of_a_layer_norm_over_one_element():
    """``x - mean`` over one element is exactly 0 in float64, and its rounding at float32's
    precision times rstd = 1/sqrt(eps) moves grad w by ~eps * |x| * 316; both ATen's layer_norm
    (its fused backward decomposed) and the decomposition have that spread."""
    x = torch.tensor([[3.0819921493530273]], dtype=F64, requires_grad=True)
    w, b = (torch.tensor([0.5], dtype=F64, requires_grad=True) for _ in range(2))
    eps32 = torch.finfo(torch.float32).eps
    for fn in (_decomp_layer_norm, _aten_layer_norm):
        def vjp(fn=fn):
            y = fn(x, w, b)
            return dict(zip("xwb", torch.autograd.grad(y, (x, w, b), torch.ones_like(y))))

        spread = rounding_spread(vjp, vjp(), seed=0)
        assert float(spread["w"]) > 0.1 * eps32 * 3.08 * 316, (fn, spread)
    noisy = lambda: {"y": x.detach() * (1 + 1e-6 * torch.rand(1, dtype=F64))}  # noqa: E731
    assert rounding_spread(noisy, noisy(), seed=0) == {}  # not repeatable: no spread


def test_a_layer_norm_over_one_element_passes_its_gradients_at_float32_rounding():
    """ATen's layer_norm against torch's own decomposition: grad w -2.7e-05 (float64: 0, the
    decomposition in float32: exactly 0) is the rounding of ``x - mean`` times rstd, within
    the rounding spread of the decomposition's VJP."""
    spec = equivalent_to(_decomp_layer_norm, inputs=_ONE_ELEMENT)(_aten_layer_norm)
    for checks in (("gradients",), ("repeated-backward",)):  # cotangent 1, then 2
        report = check(spec, settings=_cfg(n=10), checks=checks, raise_on_failure=False)
        assert report.ok, report.render()


def test_a_layer_norm_backward_off_by_a_real_amount_still_fails():
    """The weight's gradient 1% off at ordinary sizes, the unbiased variance in the backward
    over rows of two around 1000 (cancelling), and the input's gradient without the mean term
    over one element (exactly 0 in float64; ~316 |g w| here): far beyond the spread."""
    cases = [("w*1.01", _rows(6), "w"), ("unbiased", _rows(2, 1000.0), "x"),
             ("no mean", _ONE_ELEMENT, "x")]
    for bug, inputs, arg in cases:
        spec = equivalent_to(_decomp_layer_norm, inputs=inputs)(
            lambda x, w, b, bug=bug: _LayerNorm.apply(x, w, b, bug))
        report = _grad_checks(spec)
        assert not report.ok, bug
        f = report.findings[0]
        assert f.check == "gradients", (bug, report.render())
        assert f.headline == f"gradient w.r.t. {arg!r} differs from the reference on backward #1."
        assert "vs float64" in f.details


def test_a_correct_explicit_layer_norm_backward_passes():
    spec = equivalent_to(_decomp_layer_norm, inputs=_rows(6))(
        lambda x, w, b: _LayerNorm.apply(x, w, b, None))
    report = _grad_checks(spec)
    assert report.ok, report.render()


# -- low-precision forwards ------------------------------------------------------------------
def _bf16_rows():
    def build(seed: int, n: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return ((torch.randn(4, n, generator=g, dtype=F64)).to(torch.bfloat16),)

    return st.builds(build, st.integers(0, 2 ** 20), st.sampled_from([16, 32, 48]))


def _online_softmax(x, acc, block=4):
    """Flash-style softmax over blocks of columns with running max and sum in ``acc``."""
    m = torch.full(x.shape[:-1] + (1,), -float("inf"), dtype=acc)
    s = torch.zeros(x.shape[:-1] + (1,), dtype=acc)
    for j in range(0, x.shape[-1], block):
        xb = x[..., j:j + block].to(acc)
        m_new = torch.maximum(m, xb.amax(-1, keepdim=True))
        s = s * torch.exp(m - m_new) + torch.exp(xb - m_new).sum(-1, keepdim=True)
        m = m_new
    return (torch.exp(x.to(acc) - m) / s).to(x.dtype)


def _softmax_specs():
    def ref(x):
        return torch.softmax(x, -1)

    @equivalent_to(ref, inputs=_bf16_rows())
    def bf16_accumulators(x):
        return _online_softmax(x, torch.bfloat16)

    @equivalent_to(ref, inputs=_bf16_rows())
    def f32_accumulators(x):
        return _online_softmax(x, torch.float32)

    return bf16_accumulators, f32_accumulators


def test_a_bf16_softmax_accumulating_in_bf16_fails_the_forward_check():
    """bfloat16's default tolerance (rtol 1.6e-2) accepts it on rows of 16-48 values (each
    output ~1/n, within 1.6% of torch's); the baseline rule in ULPs does not."""
    buggy, _ = _softmax_specs()
    report = check(buggy, settings=_cfg(), checks=("forward",), raise_on_failure=False)
    assert not report.ok
    f = report.findings[0]
    assert f.check == "forward" and f.rule == "baseline"
    assert "the bfloat16 reference's own error" in f.details
    assert f.impl_error > 2 * f.baseline_error


def test_a_flash_style_bf16_softmax_with_float32_accumulators_passes():
    _, correct = _softmax_specs()
    report = check(correct, settings=_cfg(n=30), checks=("forward",), raise_on_failure=False)
    assert report.ok, report.render()


# -- the reference as the suspect --------------------------------------------------------------
def _strided_pairs():
    def build(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(6, 6, generator=g)
        w = torch.randn(6, 6, generator=g).t()  # a transposed weight: not contiguous
        return x, w

    return st.builds(build, st.integers(0, 2 ** 20))


def _ignores_strides(x, w):
    """``x * w`` reading ``w``'s storage as if it were contiguous (a missing .contiguous())."""
    stride = torch.empty(w.shape).stride()
    return x * w.as_strided(w.shape, stride)


def test_a_reference_ignoring_a_weights_strides_is_named_as_the_suspect():
    @equivalent_to(_ignores_strides, inputs=_strided_pairs())
    def scale(x, w):
        return x * w

    report = check(scale, settings=_cfg(n=5), checks=("forward",), raise_on_failure=False)
    assert not report.ok  # still a real discrepancy: it is reported
    f = report.findings[0]
    assert f.check == "forward"
    assert f.likely_cause.startswith("the reference is the suspect, not the implementation")
    assert "contiguous copies of the same values" in f.likely_cause and "w" in f.likely_cause
    assert "the reference on its own" in f.fix


def test_an_implementation_that_differs_from_a_correct_reference_is_not_a_suspect_reference():
    @equivalent_to(lambda x, w: x * w, inputs=_strided_pairs())
    def scale(x, w):
        return _ignores_strides(x, w)

    report = check(scale, settings=_cfg(n=5), checks=("forward",), raise_on_failure=False)
    assert not report.ok
    assert "suspect" not in (report.findings[0].likely_cause or "")


class _Stale:
    """What a reference reads from memory it does not own: 1 on its first call at each dtype
    (the record's float32 run and its float64 oracle agree on it), 0 on later calls (a fresh
    call on equal inputs returns other values), as an uninitialized buffer would."""

    seen: set = set()

    @classmethod
    def garbage(cls, t: torch.Tensor) -> float:
        first = t.dtype not in cls.seen
        cls.seen.add(t.dtype)
        return 1.0 if first else 0.0


class _StaleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 + _Stale.garbage(g)


def _vectors():
    def build(seed: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(8, generator=g).requires_grad_(),)

    return st.builds(build, st.integers(0, 2 ** 20))


def _suspect_text(report) -> str:
    """The likely cause, or for a finding that did not replay (flaky) its details."""
    f = report.findings[0]
    return (f.likely_cause or "") + f.details


def test_a_reference_returning_other_gradients_for_equal_inputs_is_the_suspect():
    _Stale.seen = set()

    @equivalent_to(_StaleBackward.apply, inputs=_vectors())
    def double(x):
        return x * 2

    report = check(double, settings=_cfg(n=1), checks=("gradients",), raise_on_failure=False)
    assert not report.ok and report.findings[0].check in ("gradients", "flaky")
    text = _suspect_text(report)
    assert "the reference is the suspect, not the implementation" in text, report.render()
    assert "different gradients on two calls with equal inputs" in text


def _stale_ref(x):
    return x * 2 + _Stale.garbage(x)


def test_a_reference_returning_other_values_for_equal_inputs_is_the_suspect():
    _Stale.seen = set()

    @equivalent_to(_stale_ref, inputs=_vectors())
    def double(x):
        return x * 2

    report = check(double, settings=_cfg(n=1), checks=("forward",), raise_on_failure=False)
    assert not report.ok and report.findings[0].check in ("forward", "flaky")
    assert "returned different values" in _suspect_text(report), report.render()


def _noisy_ref(x):
    return x * 2 + torch.rand_like(x)


def test_a_schedule_finding_against_a_nondeterministic_reference_does_not_say_save_a_clone():
    """The schedule check's "save a clone" (a stale saved value in the implementation) is
    replaced by the suspect line when the reference itself returns other values."""
    import dataclasses

    from conftest import execution
    from equiv.execution.record import Sink
    from equiv.pipeline import _name_the_suspect

    @equivalent_to(_noisy_ref, inputs=_vectors())
    def double(x):
        return x * 2

    ex = execution(double, torch.randn(8, requires_grad=True))
    sink = Sink(ex.spec, equiv.settings(), "eager", "cpu")
    sink.finding("schedule", "schedule 'mutate-after-forward[x]': gradient differs.",
                 likely_cause="a stale value.", fix="save what backward needs with "
                 "ctx.save_for_backward (autograd then raises) or save a clone.")
    sink.findings[0] = dataclasses.replace(sink.findings[0])
    _name_the_suspect(ex, sink)
    f = sink.findings[0]
    assert f.likely_cause.startswith("the reference is the suspect")
    assert "save a clone" not in f.likely_cause + f.fix


def test_a_deterministic_reference_with_a_wrong_backward_implementation_is_no_suspect():
    class _WrongBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3

    @equivalent_to(lambda x: x * 2, inputs=_vectors())
    def double(x):
        return _WrongBackward.apply(x)

    report = check(double, settings=_cfg(n=3), checks=("gradients",), raise_on_failure=False)
    assert not report.ok
    assert "suspect" not in (report.findings[0].likely_cause or "")


@pytest.mark.parametrize("fn", [
    lambda x, w: torch.nn.functional.layer_norm(x, (50,), w),
    lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
    lambda x, w: torch.softmax(x * w, -1).t() @ x,
], ids=["layer_norm", "rms_norm", "softmax_matmul"])
def test_rounding_spread_moves_results_in_place_with_the_same_numbers(fn, monkeypatch):
    """The perturbed runs move an op's new float64 result in place, chunk by chunk: the
    spread is bitwise the one of moving a copy (the generator fills chunk after chunk as it
    fills the whole), and no input is written."""
    from equiv.execution import rounding
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 50, generator=g, dtype=torch.float64)
    w = torch.randn(50, generator=g, dtype=torch.float64)
    before = x.clone(), w.clone()

    def run():
        return {"out": fn(x, w)}

    monkeypatch.setattr(rounding, "_CHUNK", 7)
    in_place = rounding.rounding_spread(run, run(), seed=3)
    moved = rounding._Perturbed._moved
    monkeypatch.setattr(rounding._Perturbed, "_moved",
                        lambda self, t, summed=1.0, owned=False: moved(self, t, summed, False))
    copied = rounding.rounding_spread(run, run(), seed=3)
    assert in_place.keys() == copied.keys() == {"out"}
    assert torch.equal(in_place["out"], copied["out"]) and bool(in_place["out"].gt(0).any())
    assert torch.equal(x, before[0]) and torch.equal(w, before[1])


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(seed=st.integers(0, 2**16), n=st.integers(1, 20), scale=st.sampled_from(
    [0.0, 1e-12, 1e-9, 1e-6]), special=st.booleans(), with_spread=st.booleans())
def test_same_up_to_float64_rounding_in_chunks(seed, n, scale, special, with_spread):
    """The probe's "same up to float64 rounding" read in chunks agrees with the test over the
    whole tensors (NaN and inf as nan_to_num makes them)."""
    from equiv.execution import rounding
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, 2, generator=g, dtype=torch.float64)
    b = a + scale * torch.randn(n, 2, generator=g, dtype=torch.float64)
    if special:
        a[0, 0], b[0, 0], a[-1, -1] = math.nan, math.nan, math.inf
    spread = torch.rand(n, 2, generator=g, dtype=torch.float64) * 1e-6 if with_spread else None
    x, y = torch.nan_to_num(a), torch.nan_to_num(b)
    diff = (x - y).abs()
    whole = bool((diff <= 1e-9 * (y.abs().max() + x.abs().max())).all()) or (
        spread is not None and bool((diff <= 1e-3 * spread).all()))
    saved, rounding._CHUNK = rounding._CHUNK, 3
    try:
        assert rounding._same(a, b, spread) == whole
    finally:
        rounding._CHUNK = saved


def test_the_oracles_spread_reads_its_own_inputs_without_copying_or_writing_them():
    """The rounding spread reruns the reference on the oracle's float64 inputs through detached
    aliases: bitwise the spread fresh float64 copies give, and the inputs (which a reference
    returning an argument as it is hands back) are left as they were."""
    from conftest import execution
    from equiv.execution.pairing import reference_run
    from equiv.numerics import oracle_dtype

    def ref(x, y):
        return x, (x - y.mean()) * 3.0  # x as it is, and a cancelling value

    @equiv.equivalent_to(ref)
    def impl(x, y):
        return x.clone(), (x - y.mean()) * 3.0

    base = torch.linspace(1000.0, 1000.001, 48)
    ex = execution(impl, base[::2], base[1::2])  # two views of one storage
    run = ex.oracle.run()
    before = [t.detach().clone() for t in run.side.tensors]
    got = {n: ex.oracle.rounding_spread(n) for n in ("output[0]", "output[1]")}
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, run.side.tensors))

    def fresh():
        side = ex.template.instantiate(grad=False, dtype=oracle_dtype(torch.float32, "cpu"))
        return reference_run(ex.spec, ex.ref_fn, side).values

    aliases = run.side.detached()
    assert [t.data_ptr() for t in aliases.tensors] == [t.data_ptr() for t in run.side.tensors]
    assert not any(t.requires_grad for t in aliases.tensors)
    want = rounding_spread(fresh, run.values, ex.cot_seed)
    assert float(got["output[1]"].max()) > 0 and torch.equal(got["output[1]"], want["output[1]"])
    assert torch.equal(got["output[0]"], want["output[0]"])
