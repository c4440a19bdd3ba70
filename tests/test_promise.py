"""A pass is a promise, as a hostile user tests it: every verdict that says pass compared
something, what a pass left out is said, and odd runs end in a report, never in a traceback.
Each false pass is caught (the verdict, the key lines); each honest twin still passes."""

from __future__ import annotations

import io
import textwrap

import hypothesis.strategies as st
import numpy as np
import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv.cli import main
from equiv.strategies import tensors
from tests.conftest import FAST


def ref2(x):
    return x * 2


def cli(tmp_path, source: str, *args: str) -> tuple[int, str]:
    path = tmp_path / "promise_specs.py"
    path.write_text(textwrap.dedent(source))
    out = io.StringIO()
    code = main(["check", str(path), "--max-examples", "8", "--seed", "0", *args],
                out=out, err=out)
    return code, out.getvalue()


def test_an_intermittent_failure_beside_a_finding_is_a_report_not_a_traceback():
    """Hypothesis raises a group of a found bug and a FlakyFailure: both become findings."""
    calls = {"n": 0}

    @equivalent_to(ref2)
    def sometimes(x):
        calls["n"] += 1
        if calls["n"] % 7 == 0:
            raise RuntimeError("intermittent")
        return x * 2

    cfg = equiv.settings(FAST, max_examples=20, seed=0)
    report = equiv.check(sometimes, settings=cfg, raise_on_failure=False)
    assert not report.ok
    assert "flaky" in {f.check for f in report.findings}


def test_the_cli_does_not_pass_a_spec_whose_every_mode_was_skipped(tmp_path):
    code, text = cli(tmp_path, '''
        import torch
        import equiv
        from equiv import equivalent_to

        def ref(x):
            return x * 2

        class Old(torch.autograd.Function):  # no setup_context: no functorch transform runs it
            @staticmethod
            def forward(ctx, x):
                return x * 3

            @staticmethod
            def backward(ctx, g):
                return g * 3

        old = equivalent_to(ref, allow_skip=("vmap", "jvp"),
                            settings=equiv.settings(modes=("vmap", "jvp")))(Old)
    ''')
    assert code == 2, text
    assert "ERROR" in text and "was skipped" in text and "nothing ran" in text


def test_a_skipped_mode_beside_one_that_ran_stays_an_allowed_skip(tmp_path):
    code, text = cli(tmp_path, '''
        import torch
        import equiv
        from equiv import equivalent_to

        def ref(x):
            return x * 2

        class Old(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return g * 2

        old = equivalent_to(ref, allow_skip=("vmap",),
                            settings=equiv.settings(modes=("eager", "vmap")))(Old)
    ''')
    assert code == 0, text
    assert "1 pass, 1 skipped" in text


def test_a_mode_in_which_no_selected_check_runs_is_not_checked():
    @equivalent_to(ref2, settings=equiv.settings(checks=("no-grad",),
                                                 modes=("eager", "compile[aot_eager]")))
    def double(x):
        return x * 2

    report = equiv.check(double, settings=equiv.settings(FAST, max_examples=5),
                         modes=("eager", "compile[aot_eager]"), raise_on_failure=False)
    assert not report.ok
    assert [r.status for r in report.runs] == ["passed", "not checked"]
    (f,) = report.findings
    assert f.check == "not-checked" and f.mode == "compile[aot_eager]"
    assert "none of the selected checks (no-grad) runs under compile[aot_eager]" in f.headline


def _int_inputs():
    return st.tuples(st.integers(0, 5).map(lambda n: torch.arange(n + 1)))


@pytest.mark.parametrize("check", ["repeated-backward", "schedule"])
def test_a_gradient_check_alone_on_integer_inputs_compared_nothing(check):
    @equivalent_to(lambda x: x * 2, inputs=_int_inputs())
    def int_triple(x):
        return x * 3

    with pytest.raises(equiv.InvalidArgument, match="compared nothing"):
        equiv.check(int_triple, settings=FAST, checks=(check,))


def test_the_same_checks_on_a_differentiable_kernel_still_catch():
    class Twice(torch.autograd.Function):  # the second backward through the graph doubles
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.calls = 0
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            ctx.calls += 1
            return 2 * x * g * ctx.calls

    spec_fn = equivalent_to(lambda x: x * x)(Twice)
    with pytest.raises(equiv.GradientMismatch):
        equiv.check(spec_fn, settings=FAST, checks=("repeated-backward",))


def test_a_pass_against_finite_differences_says_the_second_backward_was_not_compared(tmp_path):
    def square_np(x):
        return torch.from_numpy(np.square(x.detach().numpy()))

    @equivalent_to(square_np, inputs=st.tuples(tensors(shape=(3,), dtype=torch.float64,
                                                       requires_grad=True)))
    def square(x):
        return x * x

    report = equiv.check(square, settings=FAST)
    assert report.ok
    assert any(n.startswith("repeated-backward not compared: the reference cannot "
                            "differentiate") for n in report.notes), report.notes


def test_the_cli_shows_what_a_pass_did_not_compare(tmp_path):
    code, text = cli(tmp_path, '''
        import hypothesis.strategies as st
        import numpy as np
        import torch
        from equiv import equivalent_to
        from equiv.strategies import tensors

        def square_np(x):
            return torch.as_tensor(np.square(x.detach().numpy()))

        @equivalent_to(square_np, inputs=st.tuples(tensors(shape=(3,), dtype=torch.float64,
                                                           requires_grad=True)))
        def square(x):
            return x * x
    ''', "--modes", "eager")
    assert code == 0, text
    assert "promise_specs.square [eager-cpu]: repeated-backward not compared" in text
    assert "\nnot compared: " in text


def test_a_strategy_that_draws_nothing_is_not_blamed_on_the_reference():
    @equivalent_to(ref2, inputs=st.tuples(tensors(shape=(3,))).filter(lambda ex: False))
    def double(x):
        return x * 2

    with pytest.raises(equiv.InvalidArgument, match="the input strategy drew none") as info:
        equiv.check(double, settings=FAST)
    assert "reference raised" not in str(info.value)


@pytest.mark.parametrize("options, example", [
    ({"devices": "cpu"}, "e.g. ('cpu',)"), ({"checks": "forward"}, "e.g. ('forward', "),
    ({"dtypes": ()}, "names no dtype")])
def test_settings_errors_give_an_example_of_the_option_itself(options, example):
    with pytest.raises(equiv.InvalidArgument) as info:
        equiv.settings(**options)
    assert example in str(info.value)



def test_only_empty_tensors_drawn_is_not_checked():
    @equivalent_to(ref2, inputs=st.tuples(tensors(shape=(0, 4), dtype=torch.float64)))
    def triple(x):
        return x * 3  # wrong, but no element ever shows it

    report = equiv.check(triple, settings=FAST, raise_on_failure=False)
    assert not report.ok
    (f,) = report.findings
    assert f.check == "not-checked"
    assert "held only empty tensors" in f.headline and "no value" in f.headline


def test_empty_tensors_among_others_still_pass_and_catch():
    shapes = st.sampled_from([(0, 4), (2, 3)])
    inputs = st.tuples(tensors(shape=shapes, dtype=torch.float64))

    @equivalent_to(ref2, inputs=inputs)
    def double(x):
        return x * 2

    @equivalent_to(ref2, inputs=inputs)
    def triple(x):
        return x * 3

    assert equiv.check(double, settings=FAST).ok
    with pytest.raises(equiv.OutputMismatch):
        equiv.check(triple, settings=FAST)


class _TimesThousand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 1000


def test_an_output_the_reference_detaches_says_its_gradient_was_not_compared():
    @equivalent_to(lambda x: (x * 2, (x * 2).detach()),
                   inputs=st.tuples(tensors(shape=(3,), dtype=torch.float64,
                                            requires_grad=True)))
    def pair(x):
        return x * 2, _TimesThousand.apply(x)

    report = equiv.check(pair, settings=FAST)
    assert report.ok
    assert any(n.startswith("gradients through output[1] not compared: the reference returns "
                            "it without gradient") for n in report.notes)


def test_an_output_overlapping_itself_where_the_reference_repeats_is_caught():
    @equivalent_to(lambda x: x.sum().repeat(3),
                   inputs=st.tuples(tensors(shape=(4,), dtype=torch.float64)))
    def broadcast_sum(x):
        return x.sum().expand(3)

    with pytest.raises(equiv.AliasingMismatch) as info:
        equiv.check(broadcast_sum, settings=FAST)
    f = info.value.report.findings[0]
    assert f.check == "aliasing"
    assert f.headline.startswith("output overlaps itself (stride 0 along dim 0")


def test_an_expanded_output_where_the_reference_expands_too_passes():
    @equivalent_to(lambda x: x.sum().expand(3),
                   inputs=st.tuples(tensors(shape=(4,), dtype=torch.float64)))
    def broadcast_sum(x):
        return x.sum(0, keepdim=False).expand(3)

    assert equiv.check(broadcast_sum, settings=FAST).ok
