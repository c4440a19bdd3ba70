"""Diagnosis: every "Likely cause" / "Fix" line rests on evidence seen on the example, and one
bug is one root. Each case is a buggy implementation whose finding once carried a wrong line
(asserted absent) with, where a true cause exists, a twin whose line is asserted present."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors
from equiv.timeline import render

from test_timeline import _kinds, _record

from conftest import FAST  # noqa: E402
ONE = equiv.settings(FAST, max_examples=1)
KINK = "is a point where the reference is not differentiable"


def _run(impl, settings=FAST, **kw):
    return equiv.check(impl, settings=settings, raise_on_failure=False, **kw)


def _finding(report, check):
    return next(f for f in report.findings if f.check == check)


# -- kinks: a jump within the probe's radius ------------------------------------------------
class _AddcdivWrong(torch.autograd.Function):
    """a + b / c whose gradient for c forgets to square the divisor."""

    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(b, c)
        return torch.addcdiv(a, b, c)

    @staticmethod
    def backward(ctx, g):
        b, c = ctx.saved_tensors
        return g, g / c, -g * b / c


def test_a_small_divisor_is_not_a_kink():
    """b / c at c = 0.00178 is steep (its gradient moves 1% within the probe's step) but
    smooth: the wrong gradient names no kink."""
    args = (torch.tensor([0.5]), torch.tensor([0.5]), torch.tensor([0.00178]))

    @equivalent_to(torch.addcdiv, variants=(), inputs=st.just(
        tuple(a.clone().requires_grad_() for a in args)))
    def addcdiv(a, b, c):
        return _AddcdivWrong.apply(a, b, c)

    f = _finding(_run(addcdiv, ONE), "gradients")
    assert f.argument == "c"
    assert KINK not in (f.likely_cause or ""), f.likely_cause


def test_a_reference_that_raises_in_the_probe_is_no_kink():
    """The probe runs the reference in float64; one that refuses float64 gives no evidence."""
    def ref(x):
        if x.dtype == torch.float64:
            raise TypeError("float32 only")
        return x * 2

    class Triple(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3

    @equivalent_to(ref, variants=(), inputs=st.just(
        (torch.tensor([0.5, 1.0], requires_grad=True),)))
    def double(x):
        return Triple.apply(x)

    f = _finding(_run(double, equiv.settings(ONE, dtypes=("float32",))), "gradients")
    assert KINK not in (f.likely_cause or ""), f.likely_cause


def test_a_true_kink_still_says_so():
    """A hardtanh whose gradient at exactly its bound is 2 (neither of clamp's one-sided
    derivatives there, 1 and 0) against clamp: the gradient jumps there."""
    @equivalent_to(lambda x: torch.clamp(x, -1.0, 1.0),
                   examples=[(torch.tensor([0.5, 1.0, -2.0, 3.0], requires_grad=True),)])
    def hardtanh(x):
        at_bound = (x.detach().abs() == 1).to(x.dtype)
        return torch.nn.functional.hardtanh(x) + 2 * (x - x.detach()) * at_bound

    f = _finding(_run(hardtanh, ONE), "gradients")
    assert f.likely_cause.startswith(f"x[1] = 1 {KINK}"), f.likely_cause


# -- double backward: "partly differentiable" only where the forward matched ----------------
class _XSinX(torch.autograd.Function):
    """x * sin(x) whose backward drops the product rule's second term."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sin(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sin(x)


def test_a_wrong_first_derivative_gives_double_backward_no_partly_differentiable_fix():
    @equivalent_to(lambda x: x * torch.sin(x))
    def xsinx(x):
        return _XSinX.apply(x)

    report = _run(xsinx)
    root = report.findings[0]
    assert root.check == "gradients" and root.caused_by is None
    for f in report.findings:
        if f.check == "double-backward":
            assert f.caused_by == 0
            assert "partly differentiable" not in (f.likely_cause or "")
            assert f.fix is None, f.fix  # "save inputs or outputs" is not this bug's fix


# -- no-grad: "another code path" only where the values differ from the graded call ----------
def test_a_fast_path_under_no_grad_is_named_as_such():
    @equivalent_to(torch.nn.functional.silu)
    def silu(x):
        if torch.is_grad_enabled() and x.requires_grad:
            return torch.nn.functional.silu(x)
        return x * torch.sigmoid(x * 1.01)  # the inference path is wrong

    f = _finding(_run(silu), "no-grad")
    assert f.likely_cause.startswith("the implementation takes another code path"), f
    assert "differ from the implementation's own with gradients" in f.likely_cause


def test_no_grad_values_equal_to_the_graded_call_are_no_finding():
    """A layer norm whose mean of a constant (expanded) row rounds away from the row: within
    the forward check's rounding floor, and the no-grad call returns bitwise what the graded
    call returns: no no-grad finding, and no code path blamed."""
    def ln(x):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)

    storage = torch.tensor([3.0819921493530273])
    x = storage.as_strided((1, 7), (7, 0), 0)

    @equivalent_to(lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:]), variants=(),
                   inputs=st.just((x.clone().requires_grad_(),)))
    def layer_norm(x):
        return ln(x)

    report = _run(layer_norm, ONE)
    assert not [f for f in report.findings if f.check == "no-grad"], report.render()


# -- timeline: "untracked" only for a tensor that outlived the write ------------------------
def test_an_out_write_into_a_freed_temporary_is_not_untracked():
    x = torch.tensor([1.0, 2.0], requires_grad=True)

    def f(x):
        with torch.no_grad():
            torch.mul(x, 2, out=torch.empty_like(x))  # a temporary, freed at once
        return x * x

    events = _record(f, x)
    (write,) = _kinds(events, "write")
    assert write["tracked"] is None
    text = render(events)
    assert "untracked" not in text and "version not observed" in text


def test_a_data_write_to_an_argument_is_untracked():
    x = torch.tensor([1.0, 2.0], requires_grad=True)

    def f(x):
        y = x * x
        x.data.add_(1.0)
        return y

    text = render(_record(f, x))
    assert "version NOT bumped: untracked" in text


# -- one bug, one root ---------------------------------------------------------------------
def test_a_stale_argument_write_is_one_root_with_its_gradient_following():
    """examples/failing/x_squared_advance: the undeclared write is the root; the gradient whose
    timeline shows that write overwriting the saved value follows it."""
    @equivalent_to(lambda x: x * x, examples=[(torch.tensor([1.0], requires_grad=True),)])
    def square_advance(x):
        y = x * x
        x.data.add_(1.0)
        return y

    report = _run(square_advance, ONE)
    assert [(f.check, f.caused_by) for f in report.findings] == [("mutation", None),
                                                                 ("gradients", 0)]


def test_a_mutation_beside_an_unrelated_cut_gradient_stays_two_roots():
    @equivalent_to(lambda x, w: x * w)
    def two_bugs(x, w):
        y = x * w.detach()  # cut gradient for w
        x.detach().add_(1.0)  # undeclared write to x, after the multiply
        return y

    report = _run(two_bugs)
    assert len(report.roots()) == 2, [(f.check, f.caused_by) for f in report.findings]


def test_a_missing_mark_dirty_is_the_root_of_its_gradient_finding():
    class ReluInplace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.clamp_(min=0)
            ctx.save_for_backward(x)
            return x

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * (y > 0)

    @equivalent_to(torch.relu, mutates={"x": "out"})
    def relu_(x):
        return ReluInplace.apply(x)

    report = _run(relu_)
    assert report.findings[0].check == "mark-dirty"
    assert len(report.roots()) == 1, [(f.check, f.caused_by) for f in report.findings]


def test_several_outputs_of_one_wrong_call_are_one_root():
    @equivalent_to(lambda x: (x + 1, x + 2, x + 3), variants=())
    def three(x):
        y = torch.stack([x + 2, x + 1, x + 3])  # the first two swapped
        return y[0].clone(), y[1].clone(), y[2].clone()

    report = _run(three)
    assert len(report.roots()) == 1, [(f.check, f.argument, f.caused_by) for f in report.findings]
    assert {f.argument for f in report.findings if f.check == "forward"} == {"output[0]",
                                                                           "output[1]"}


# -- reproductions that run as printed ------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent

BIG = textwrap.dedent('''
    import torch
    import equiv
    from equiv import equivalent_to

    def rowsum_ref(x):
        return x.sum(-1)

    EXAMPLE = [(torch.arange(5600.0).reshape(70, 80).t(),)]  # over 4096 elements, transposed

    @equivalent_to(rowsum_ref, variants=(), examples=EXAMPLE)
    def rowsum_big(x):
        wrong = not x.is_contiguous() and bool((x > 5000).any())  # a bad strided fast path
        return x.sum(-1) + wrong * 1.0

    @equivalent_to(rowsum_ref, variants=(), examples=EXAMPLE,
                   settings=equiv.settings(max_examples=1))
    def rowsum_good(x):
        return x.sum(-1)
''')

MODULE = textwrap.dedent('''
    import torch
    from torch import nn
    import equiv
    from equiv import equivalent_to


    class ThreeProj(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))

        def forward(self, x):
            return self.q(x), self.k(x), self.v(x)


    def qkv_state(sd):
        return {f"qkv.{p}": torch.cat([sd[f"{n}.{p}"] for n in "qkv"]) for p in ("weight", "bias")}


    class FusedQKVGood(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim)

        def forward(self, x):
            return tuple(t.clone() for t in self.qkv(x).chunk(3, -1))


    class FusedQKV(FusedQKVGood):
        def forward(self, x):  # a fast path for large weights (81 of them: not printed as a list)
            q, k, v = super().forward(x)
            return q, k, v + (self.qkv.weight.detach().abs().max() > 40) * 1e-2


    for cls, n in ((FusedQKV, 60), (FusedQKVGood, 1)):
        equivalent_to(ThreeProj, init=dict(dim=9), state_map=qkv_state, input_shapes=(..., 9),
                      settings=equiv.settings(max_examples=n))(cls)
''')

#: runs each printed code (JSON on stdin) in a fresh namespace; prints how each ended
RUNNER = textwrap.dedent('''
    import json, sys, traceback
    out = []
    for code in json.load(sys.stdin):
        try:
            exec(code, {"__name__": "__main__"})
            out.append(None)
        except AssertionError as e:
            out.append({"assertion": True, "text": f"{type(e).__name__}: {e}"})
        except Exception as e:
            out.append({"assertion": False, "text": "".join(traceback.format_exception(e))})
    print(json.dumps(out))
''')


def _printed(targets: list[str], cwd: Path) -> list[dict]:
    out = cwd / "report.json"
    subprocess.run([sys.executable, "-m", "equiv", "check", *targets, "--modes", "eager",
                    "--json", str(out)], cwd=cwd, capture_output=True, text=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    doc = json.loads(out.read_text())
    return [f for result in doc["results"] for f in result["findings"]]


def _run_printed(codes: list[str], cwd: Path, path: list[Path]) -> list[dict | None]:
    run = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(codes), cwd=cwd,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [ROOT, *path]))})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_printed_reproductions_run_and_fail_the_same_way(tmp_path):
    # every finding of examples/failing/, of a storage over 4096 elements and of a module pair
    # with a state map: its printed code runs as printed, in a fresh process and namespace, and
    # raises its finding's failure; the same code with the correct twin's name passes
    failing, cases = ROOT / "examples" / "failing", tmp_path / "cases"
    cases.mkdir()
    (cases / "big_rowsum.py").write_text(BIG)
    (cases / "fused_qkv.py").write_text(MODULE)
    findings = _printed([str(failing), str(cases)], tmp_path)
    specs = {f["spec"].rsplit(".", 1)[-1] for f in findings}
    assert specs == {"scale_stale", "square_advance", "rowsum_big", "FusedQKV"}, specs
    codes = {f["spec"].rsplit(".", 1)[-1]: f["example"]["code"] for f in findings}
    saved = list(tmp_path.glob("equiv-example-*.pt"))  # beside the report
    assert len(saved) == 1 and f"torch.load({str(saved[0])!r})" in codes["rowsum_big"], saved
    assert codes["FusedQKV"].splitlines()[-1].startswith("equiv.assert_equivalent(FusedQKV, x, ")
    twins = [re.sub(rf"\b{bad}\b", good, codes[bad])
             for bad, good in (("rowsum_big", "rowsum_good"), ("FusedQKV", "FusedQKVGood"))]
    ran = _run_printed([f["example"]["code"] for f in findings] + twins, tmp_path,
                       [failing, cases])
    for f, result in zip(findings, ran):
        code = f["example"]["code"]
        assert "elided" not in code and "randn" not in code and "import equiv" in code, code
        assert result is not None and result["assertion"], (code, result)
        assert f"{f['kind']}: {f['headline']}" in result["text"], (code, result["text"][-2000:])
    assert ran[len(findings):] == [None, None], (twins, ran[len(findings):])


def test_a_fused_qkv_with_a_wrong_split_is_one_root():
    """Three wrong outputs of one call and the gradients after them: one story."""
    from test_modules import _qkv

    report = _run(_qkv(True))
    assert len(report.findings) > 3
    assert len(report.roots()) == 1, [(f.check, f.argument, f.caused_by)
                                      for f in report.findings]


def test_anomaly_mode_warnings_stay_off_stderr(capfd):
    class Raises(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("backward fails")

    @equivalent_to(lambda x: x * 2)
    def double(x):
        return Raises.apply(x)

    with torch.autograd.detect_anomaly():
        report = _run(double)
        try:
            equiv.assert_equivalent(double, torch.tensor([1.0], requires_grad=True))
        except equiv.GradientMismatch as e:
            header = str(e).splitlines()[:2]
    assert report.findings[0].check == "gradients"
    assert "Error detected in" not in capfd.readouterr().err
    assert "(1 example, 0 rejected as invalid; modes eager; devices cpu; the given example)" \
        in header[0]
    assert "max_examples" not in header[1] and "no example drawn" in header[1]
