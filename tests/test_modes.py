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

FAST = equiv.settings(max_examples=6, seed=1234, derandomize=True,
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
