"""Execution modes: compile backends, functionalize, vmap, devices, and the honest account of
what ran (compilations, graph breaks, 'not compiled', 'skipped')."""

from __future__ import annotations

import subprocess
import sys

import hypothesis
import pytest
import torch
from hypothesis import strategies as st

import equiv
from equiv import check, equivalent_to
from equiv.strategies import shapes, tensors

FAST = equiv.settings(max_examples=6, seed=1234, derandomize=True, modes=("eager",),
                      hypothesis_settings=hypothesis.settings(database=None))


def _run(mode: str):
    return lambda r: next(x for x in r.runs if x.mode == mode)


# -- the seed: an autograd.Function called with the same tensor in two slots ------------------
class MyFn(torch.autograd.Function):
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
            return dq, dk + dv, None, None  # backward pre-aggregates; None for the v slot
        return dq, dk, dv, None


def seed_ref(q, k):
    return q * (k + k) * k


_QK = st.tuples(tensors(shape=(4,), dtype=torch.float64, requires_grad=True),
                tensors(shape=(4,), dtype=torch.float64, requires_grad=True, salt=1))


def _seed_spec():
    @equivalent_to(seed_ref, inputs=_QK)
    def seed_impl(q, k):
        return MyFn.apply(q, k, k, True) * k

    return seed_impl


def test_seed_graph_break_is_reported_and_gradients_match():
    """The duplicate-input apply graph-breaks under compile; equiv says so and passes."""
    report = check(_seed_spec(), settings=FAST, modes=("eager", "compile[aot_eager]"))
    assert report.ok
    run = _run("compile[aot_eager]")(report)
    assert run.status == "passed"
    assert run.compilations >= 1
    assert run.graph_breaks >= 1
    assert any("duplicate tensor input" in r for r in run.break_reasons)
    text = report.render()
    assert "mode compile[aot_eager] on cpu: passed" in text
    assert "duplicate tensor input" in text


def test_seed_fullgraph_reports_unsupported_as_a_mode_specific_error():
    """fullgraph=True: Dynamo's Unsupported is a finding of that mode, not a crash."""
    with pytest.raises(equiv.ErrorMismatch) as info:
        check(_seed_spec(), settings=FAST, modes=("eager", "compile[aot_eager,fullgraph]"))
    report = info.value.report
    (f,) = report.findings
    assert f.check == "error-parity"
    assert f.mode == "compile[aot_eager,fullgraph]"
    assert "under compile[aot_eager,fullgraph] raised Unsupported" in f.headline
    assert "duplicate tensor input" in f.details
    assert _run("eager")(report).status == "passed"
    assert _run("compile[aot_eager,fullgraph]")(report).status == "FAIL"


def drop_leaf_grads(gm, example_inputs):
    """A deliberately broken backend: the graph's leaf inputs lose their gradient."""
    def run(*args):
        return gm(*[a.detach() if isinstance(a, torch.Tensor) and a.is_leaf else a
                    for a in args])
    return run


def passthrough(gm, example_inputs):
    return gm.forward


def test_broken_backend_gradient_divergence_on_k_is_attributed_to_the_compiled_mode():
    """A backend that drops one slot's gradient contribution: gradient w.r.t. k diverges."""
    with pytest.raises(equiv.GradientMismatch) as info:
        check(_seed_spec(), settings=FAST, modes=("eager", equiv.compiled(drop_leaf_grads)))
    report = info.value.report
    fs = [f for f in report.findings if f.check == "gradients"]
    assert fs and all(f.mode == "compile[drop_leaf_grads]" for f in report.findings)
    assert any(f.argument == "k" and "gradient w.r.t. 'k'" in f.headline for f in fs)
    assert not any(f.argument == "q" for f in fs)
    assert "the compiler diverges from eager on this program" in fs[0].attribution
    assert "Attribution: the compiler diverges" in report.render()
    assert _run("eager")(report).status == "passed"


def test_correct_backend_twin_passes():
    report = check(_seed_spec(), settings=FAST, modes=(equiv.compiled(passthrough),))
    assert report.ok and report.runs[0].status == "passed"
    assert report.runs[0].mode == "compile[passthrough]"


# -- a real compile-only divergence on torch 2.13 CPU: overlapping views ----------------------
def _overlap_final_b(a2, b):
    """b's values after a was doubled in place, when b overlaps a one element later."""
    same = a2.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    if same and b.storage_offset() - a2.storage_offset() == 1:
        return torch.cat([a2[1:], b[-1:]])
    return b


def scale_then_add_ref(a, b):
    a2 = a * 2
    return a2, a2 + _overlap_final_b_ref(a, a2, b)


def _overlap_final_b_ref(a, a2, b):
    same = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    if same and b.storage_offset() - a.storage_offset() == 1:
        return torch.cat([a2[1:], b[-1:]])
    return b


def _separate():
    return (torch.arange(3.0), torch.arange(3.0) + 10)


def _overlapping():
    base = torch.arange(4.0)
    return (base[:3], base[1:])


def _overlap_spec(examples):
    @equivalent_to(scale_then_add_ref, mutates={"a": 0},
                   inputs=st.sampled_from([0, 1]).map(
                       lambda i: _separate() if i == 0 else _overlapping()),
                   examples=examples)
    def scale_then_add_(a, b):
        a.mul_(2)
        return a, a + b

    return scale_then_add_


def test_overlapping_views_compile_only_divergence_is_caught_and_attributed():
    """aot_eager reuses a graph compiled for separate inputs on overlapping views: wrong."""
    with pytest.raises(equiv.OutputMismatch) as info:
        check(_overlap_spec([_overlapping(), _separate()]), settings=FAST,
              modes=("eager", "compile[aot_eager]"))
    report = info.value.report
    assert {f.mode for f in report.findings} == {"compile[aot_eager]"}
    f = report.findings[0]
    assert f.check == "forward" and f.argument == "output[1]"
    assert "b=f32[3] cpu (overlaps a (2 shared elements), storage offset 1)" in f.example
    assert f.attribution.startswith("only the implementation under compile[aot_eager] diverges")
    assert _run("eager")(report).status == "passed"
    assert _run("compile[aot_eager]")(report).status == "FAIL"


def test_compiled_for_overlapping_views_then_called_on_separate_tensors_raises():
    """The reverse order: the graph compiled for overlapping views breaks on separate ones."""
    with pytest.raises(equiv.ErrorMismatch) as info:
        check(_overlap_spec([_separate(), _overlapping()]), settings=FAST,
              modes=("eager", "compile[aot_eager]"))
    f = info.value.report.findings[0]
    assert f.mode == "compile[aot_eager]" and f.check == "error-parity"
    assert "the implementation under compile[aot_eager] raised RuntimeError" in f.headline
    assert "out of bounds for storage" in f.details
    assert f.attribution.startswith("only the implementation under compile[aot_eager]")


def test_overlapping_views_twin_passes_with_the_eager_backend():
    report = check(_overlap_spec([_overlapping(), _separate()]), settings=FAST,
                   modes=("eager", "compile[eager]"))
    assert report.ok
    assert [r.status for r in report.runs] == ["passed", "passed"]


# -- graph breaks, recompile limit ------------------------------------------------------------
def normalise_ref(x):
    return x / x.abs().max()


def test_graph_break_is_reported():
    """``.item()`` breaks the graph: counted and named in the report, and the run passes."""
    @equivalent_to(normalise_ref, mutates={"x": "out"},
                   inputs=st.tuples(tensors(shape=(5,), dtype=torch.float64)))
    def normalise_(x):
        return x.div_(x.abs().max().item())

    report = check(normalise_, settings=FAST, modes=("compile[eager]",))
    (run,) = report.runs
    assert run.status == "passed" and run.graph_breaks >= 1
    assert any("item()" in r for r in run.break_reasons), run.break_reasons
    assert "graph break" in run.info
    assert "mode compile[eager] on cpu: passed" in report.render()
    assert "graph break" in report.render()


def twice_ref(x):
    return x * 2


def test_recompile_limit_fallback_is_reported_as_not_compiled():
    """Hitting the recompile limit is 'not compiled', never a pass."""
    @equivalent_to(twice_ref, inputs=st.tuples(tensors(shape=shapes(min_dims=1, max_dims=3),
                                                       dtype=torch.float64)))
    def twice(x):
        return x * 2

    mode = equiv.compiled("eager", dynamic=False, recompile_limit=1)
    with pytest.raises(equiv.EquivalenceFailure) as info:
        check(twice, settings=equiv.settings(FAST, max_examples=10), modes=(mode,))
    report = info.value.report
    (run,) = report.runs
    assert run.status == "not compiled"
    assert "recompile limit (1)" in run.reason
    (f,) = report.findings
    assert f.check == "not-compiled" and f.mode == "compile[eager,dynamic=False]"
    assert "this is not a pass" in f.headline


def test_dynamic_shapes_twin_compiles_once_and_passes():
    @equivalent_to(twice_ref, inputs=st.tuples(tensors(
        shape=shapes(min_dims=1, max_dims=1, min_side=2, max_side=6), dtype=torch.float64)))
    def twice(x):
        return x * 2

    report = check(twice, settings=equiv.settings(FAST, max_examples=10),
                   modes=(equiv.compiled("eager", dynamic=True, recompile_limit=1),))
    (run,) = report.runs
    assert run.status == "passed" and run.compilations == 1 and run.examples >= 5


# -- error parity across modes ----------------------------------------------------------------
def matvec_ref(m, v):
    return torch.mv(m, v)


_MV = st.tuples(tensors(shape=(3, 3), dtype=torch.float64),
                tensors(shape=st.sampled_from([(3,), (4,)]), dtype=torch.float64))


def test_error_parity_compiled_error_is_unwrapped():
    """A shape error raised inside the compiled graph matches the reference's error type."""
    @equivalent_to(matvec_ref, inputs=_MV)
    def matvec(m, v):
        return (m * v).sum(-1)  # broadcasting raises RuntimeError for the (4,) case, like mv

    report = check(matvec, settings=equiv.settings(FAST, max_examples=10),
                   modes=("eager", "compile[aot_eager]"))
    assert report.ok and report.invalid_examples >= 1


def test_error_parity_mode_that_returns_where_reference_raises():
    @equivalent_to(matvec_ref, inputs=_MV)
    def matvec_lenient(m, v):
        return (m[:, : v.shape[0]] * v[: m.shape[1]]).sum(-1)  # never raises

    with pytest.raises(equiv.ErrorMismatch) as info:
        check(matvec_lenient, settings=equiv.settings(FAST, max_examples=10),
              modes=("compile[aot_eager]",))
    f = info.value.report.findings[0]
    assert f.mode == "compile[aot_eager]"
    assert "the reference raised RuntimeError but the implementation under compile[aot_eager] " \
           "returned normally" in f.headline


def test_normalise_error_unwraps_dynamo_wrappers():
    from equiv._compat import dynamo
    from equiv.modes import normalise_error

    exc = dynamo().exc.TorchRuntimeError("RuntimeError when making fake tensor call\n"
                                         "ValueError: bad size 4")
    out = normalise_error(exc)
    assert type(out) is ValueError and str(out) == "bad size 4" and out.__cause__ is exc
    inner = KeyError("k")
    wrapped = dynamo().exc.TorchRuntimeError("wrapper")
    wrapped.__cause__ = inner
    assert normalise_error(wrapped) is inner
    plain = ValueError("user")
    assert normalise_error(plain) is plain


# -- functionalize and vmap: bugs eager cannot see --------------------------------------------
def double_ref(x):
    return x * 2


_X = st.tuples(tensors(shape=(4,), dtype=torch.float64))


def test_functionalize_catches_a_write_invisible_to_the_dispatcher():
    """A write through .numpy() is lost under functionalize (and so under tracing)."""
    @equivalent_to(double_ref, mutates={"x": "out"}, inputs=_X)
    def double_numpy_(x):
        x.numpy()[...] *= 2
        return x

    with pytest.raises(equiv.EquivalenceFailure) as info:
        check(double_numpy_, settings=FAST, modes=("eager", "functionalize"))
    report = info.value.report
    assert {f.mode for f in report.findings} == {"functionalize"}
    assert any(f.check == "mutation" and f.argument == "x" for f in report.findings)
    assert _run("eager")(report).status == "passed"
    assert report.findings[0].attribution.startswith("only the implementation under "
                                                     "functionalize diverges")


def test_functionalize_twin_passes():
    @equivalent_to(double_ref, mutates={"x": "out"}, inputs=_X)
    def double_(x):
        return x.mul_(2)

    report = check(double_, settings=FAST, modes=("eager", "functionalize"))
    assert report.ok and [r.status for r in report.runs] == ["passed", "passed"]
    assert any("gradients are not compared" in n for n in report.notes)


def rowscale_ref(x, w):
    return x * w.sum(-1, keepdim=True)


def _rowscale_fn(respect_in_dims: bool):
    class RowScale(torch.autograd.Function):
        generate_vmap_rule = False

        @staticmethod
        def forward(x, w):
            return x * w.sum(-1, keepdim=True)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def vmap(info, in_dims, x, w):
            if respect_in_dims:  # move the batch dimension first, as the rule assumes
                x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x
                w = w.movedim(in_dims[1], 0) if in_dims[1] is not None else w
            return x * w.sum(-1, keepdim=True), 0

    return RowScale


_XW = st.tuples(tensors(shape=(2, 3), dtype=torch.float64),
                tensors(shape=(2, 3), dtype=torch.float64, salt=1))


def test_vmap_catches_a_vmap_rule_that_ignores_in_dims():
    fn = _rowscale_fn(False)

    @equivalent_to(rowscale_ref, inputs=_XW)
    def rowscale(x, w):
        return fn.apply(x, w)

    with pytest.raises(equiv.EquivalenceFailure) as info:
        check(rowscale, settings=FAST, modes=("eager", "vmap"))
    report = info.value.report
    assert {f.mode for f in report.findings} == {"vmap"}
    f = report.findings[0]
    assert f.check == "forward" and "batch dimension last (in_dims=-1)" in f.headline
    assert _run("eager")(report).status == "passed"


def test_vmap_twin_with_a_correct_rule_passes():
    fn = _rowscale_fn(True)

    @equivalent_to(rowscale_ref, inputs=_XW)
    def rowscale(x, w):
        return fn.apply(x, w)

    report = check(rowscale, settings=FAST, modes=("eager", "vmap"))
    assert report.ok and _run("vmap")(report).status == "passed"


def test_vmap_unsupported_function_is_skipped_not_passed():
    class OldStyle(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w.sum(-1, keepdim=True)

        @staticmethod
        def backward(ctx, g):
            raise NotImplementedError

    @equivalent_to(rowscale_ref, inputs=_XW)
    def rowscale(x, w):
        return OldStyle.apply(x, w)

    report = check(rowscale, settings=FAST, modes=("vmap",), checks=("forward",),
                   raise_on_failure=False)
    (run,) = report.runs
    assert run.status == "skipped" and run.reason.startswith("unsupported: the implementation")
    assert "vmap on cpu: skipped" in report.render()
    # a requested mode that was skipped is not a pass unless allow_skip names it
    assert not report.ok and [f.check for f in report.findings] == ["not-checked"]


# -- devices ----------------------------------------------------------------------------------
def test_every_requested_device_skipped_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(equiv.InvalidArgument, match="every requested device was skipped"):
        check(_seed_spec(), settings=FAST, devices=("cuda",))


def test_unavailable_device_is_skipped_with_a_reason():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    report = check(_seed_spec(), settings=FAST, devices=("cpu", "cuda"))
    assert report.ok
    cuda = [r for r in report.runs if r.device == "cuda"]
    assert cuda and cuda[0].status == "skipped" and "CUDA is not available" in cuda[0].reason


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eager_and_compiled():
    report = check(_seed_spec(), settings=FAST, devices=("cuda",),
                   modes=("eager", "compile[aot_eager]"))
    assert report.ok and all(r.status == "passed" for r in report.runs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float32_against_a_float64_cpu_reference():
    @equivalent_to(naive_logsumexp_ref, inputs=st.tuples(tensors(shape=(2, 3),
                                                                 dtype=torch.float32)))
    def lse(x):
        return torch.logsumexp(x, -1)

    report = check(lse, settings=FAST, devices=("cuda",), reference_device="cpu",
                   reference_dtype=torch.float64, modes=("eager", "compile[inductor]"))
    assert report.ok and [r.status for r in report.runs] == ["passed", "passed"]


# -- the surface --------------------------------------------------------------------------------
def test_unknown_mode_is_a_clear_error():
    with pytest.raises(equiv.InvalidArgument, match="compile\\[aot\\]: .aot. is not a torch.compile backend"):
        check(_seed_spec(), settings=FAST, modes=("compile[aot]",))
    with pytest.raises(equiv.InvalidArgument, match="unknown option 'fast'"):
        check(_seed_spec(), settings=FAST, modes=("compile[eager,fast]",))
    with pytest.raises(equiv.InvalidArgument, match="compiled\\(backend=3\\)"):
        equiv.compiled(3)


def test_import_equiv_does_not_load_dynamo():
    code = ("import sys, equiv; "
            "bad = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- replay -------------------------------------------------------------------------------------
def test_a_finding_that_does_not_reproduce_on_replay_is_marked_flaky():
    """Wrong on exactly one call (think: a nondeterministic kernel): kept, marked flaky."""
    calls = {"n": 0}

    @equivalent_to(double_ref, inputs=_X)
    def double_once_wrong(x):
        calls["n"] += 1
        return x * (3 if calls["n"] == 1 else 2)

    with pytest.raises(equiv.EquivalenceFailure) as info:
        check(double_once_wrong, settings=FAST, modes=("eager",), checks=("forward",))
    report = info.value.report
    assert report.runs[0].status == "flaky"
    assert report.findings and all("flaky" in (f.attribution or f.headline)
                                   for f in report.findings)


# -- a float64 reference on CPU ------------------------------------------------------------------
def naive_logsumexp_ref(x):
    return torch.log(torch.exp(x).sum(-1))


_BIG = st.tuples(tensors(shape=(2, 3), dtype=torch.float32, scale=60.0, requires_grad=True))


def test_float64_reference_exposes_an_overflow_a_same_precision_reference_shares():
    @equivalent_to(naive_logsumexp_ref, inputs=_BIG)
    def logsumexp_naive(x):
        return torch.log(torch.exp(x).sum(-1))

    assert check(logsumexp_naive, settings=FAST).ok  # same formula, same float32 overflow
    with pytest.raises(equiv.EquivalenceFailure) as info:
        check(logsumexp_naive, settings=FAST, reference_device="cpu",
              reference_dtype=torch.float64)
    report = info.value.report
    f = next(f for f in report.findings if f.check == "forward")
    assert f.dtype == "torch.float32" and f.max_abs > 1e30  # an overflow, not rounding
    assert "x=f32[2,3] cpu grad" in f.example
    assert "reference run on cpu in torch.float64" in report.render()


def test_float64_reference_twin_passes_within_float32_tolerance():
    @equivalent_to(naive_logsumexp_ref, inputs=_BIG)
    def logsumexp_stable(x):
        return torch.logsumexp(x, -1)

    report = check(logsumexp_stable, settings=FAST, reference_device="cpu",
                   reference_dtype=torch.float64, modes=("eager", "compile[eager]"))
    assert report.ok and [r.status for r in report.runs] == ["passed", "passed"]


def test_reference_dtype_must_be_floating():
    with pytest.raises(equiv.InvalidArgument, match="reference_dtype=torch.int64"):
        check(_seed_spec(), settings=FAST, reference_dtype=torch.int64)


# -- jvp: forward-mode AD -------------------------------------------------------------------------
def square_ref(x):
    return x * x


def _square_fn(right_jvp: bool):
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            (x,) = inputs
            ctx.save_for_backward(x)
            ctx.x = x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

        @staticmethod
        def jvp(ctx, t):
            return (2 if right_jvp else 1) * ctx.x * t

    return Square


_XG = st.tuples(tensors(shape=(3,), dtype=torch.float64, requires_grad=True))


def test_jvp_catches_a_wrong_forward_mode_formula_eager_cannot_see():
    fn = _square_fn(False)

    @equivalent_to(square_ref, inputs=_XG)
    def square(x):
        return fn.apply(x)

    with pytest.raises(equiv.GradientMismatch) as info:
        check(square, settings=FAST, modes=("eager", "jvp"))
    report = info.value.report
    (f,) = report.findings
    assert f.mode == "jvp" and f.argument == "output"
    assert "forward-mode derivative (jvp) of output differs" in f.headline
    assert _run("eager")(report).status == "passed"


def test_jvp_twin_passes_and_in_place_mutation_is_differentiated():
    fn = _square_fn(True)

    @equivalent_to(square_ref, inputs=_XG)
    def square(x):
        return fn.apply(x)

    assert check(square, settings=FAST, modes=("jvp",)).runs[0].status == "passed"

    @equivalent_to(square_ref, mutates={"x": "out"}, inputs=_XG)
    def square_(x):
        return x.mul_(x.clone())

    assert check(square_, settings=FAST, modes=("eager", "jvp")).ok


def test_jvp_without_a_forward_formula_is_skipped():
    class NoJvp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * x

        @staticmethod
        def backward(ctx, g):
            return g

    @equivalent_to(square_ref, inputs=_XG)
    def square(x):
        return NoJvp.apply(x)

    report = check(square, settings=FAST, modes=("jvp",), checks=("forward", "gradients"),
                   raise_on_failure=False)
    (run,) = report.runs
    assert run.status == "skipped" and "no forward-mode derivative" in run.reason
    assert [f.check for f in report.findings] == ["not-checked"]
    assert "allow_skip=('jvp',)" in report.findings[0].fix


# -- a second real compile-only divergence (torch 2.13 CPU): a mark_dirty Function ------------------
class SiLUInPlace(torch.autograd.Function):
    """Writes x * sigmoid(x) into x, marks it dirty, saves its output (correct in eager)."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        x.mul_(s)
        ctx.mark_dirty(x)
        ctx.save_for_backward(s, x)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable  # s is a constant to autograd: no 2nd order
    def backward(ctx, grad):
        s, y = ctx.saved_tensors
        return grad * (s + y * (1 - s))


def silu_ref(x):
    return x * torch.sigmoid(x)


@pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                    reason="the divergence is measured on torch 2.13")
def test_mark_dirty_function_gradient_diverges_only_when_compiled():
    @equivalent_to(silu_ref, mutates={"x": "out"},
                   inputs=st.tuples(tensors(shape=(3,), requires_grad=True)))
    def silu_(x):
        return SiLUInPlace.apply(x)

    with pytest.raises(equiv.GradientMismatch) as info:
        check(silu_, settings=FAST, modes=("eager", "compile[aot_eager]"))
    report = info.value.report
    assert {f.mode for f in report.findings} == {"compile[aot_eager]"}
    f = next(f for f in report.findings if f.check == "gradients")
    assert f.argument == "x" and f.attribution.startswith("only the implementation under")
    assert _run("eager")(report).status == "passed"


def test_compile_modes_draw_compile_friendly_derived_inputs():
    """Inputs derived from the signature use compile-friendly shapes under compile modes, so
    compilations stay bounded (<= 3) where eager's edge-case shapes would recompile each time."""

    @equivalent_to(lambda x, y: x * y + x)
    def fma(x, y):
        return torch.addcmul(x, x, y)

    report = check(fma, settings=equiv.settings(FAST, max_examples=40),
                   modes=("compile[eager]",))
    (run,) = report.runs
    assert run.status == "passed" and run.examples >= 30
    assert run.compilations is not None and 1 <= run.compilations <= 3, run
