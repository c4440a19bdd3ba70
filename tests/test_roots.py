"""Root and follow-on findings (equiv._roots), and honest numbers and reproductions in the
printed report: NaN as NaN, no ULP distance against an exact zero, untruncated ``not
compared:`` lines, a module reproduction that imports its ``state_map``."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv.cli import main
from equiv.numerics import judge
from equiv.report import Finding, Report

COMPILE = "compile[aot_eager]"


@pytest.fixture(autouse=True)
def _default_profile(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("EQUIV_PROFILE", raising=False)
    previous = equiv.settings._push_session("default")
    yield
    equiv.settings._pop_session(previous)


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    return main(list(argv), out=out, err=err), out.getvalue()


def _ref_double(x):
    return x * 2


WRONG_FORWARD = textwrap.dedent('''
    from equiv import equivalent_to

    def ref(x):
        return x * 2

    @equivalent_to(ref)
    def scale(x):
        return x * 2.01
''')


# -- one bug, one root ----------------------------------------------------------------------
def test_wrong_forward_in_two_modes_is_one_root():
    @equivalent_to(_ref_double)
    def scale(x):
        return x * 2.01

    report = equiv.check(scale, modes=("eager", COMPILE), max_examples=5, seed=3,
                         raise_on_failure=False)
    fs = report.findings
    assert (fs[0].check, fs[0].mode, fs[0].caused_by) == ("forward", "eager", None)
    assert {(f.check, f.mode) for f in fs[1:]} >= {("gradients", "eager"), ("forward", COMPILE)}
    assert all(f.caused_by == 0 for f in fs[1:])
    assert [d["caused_by"] for d in report.to_dict()["findings"]] == [None] + [0] * (len(fs) - 1)
    text = report.render()
    assert f"1 finding (+{len(fs) - 1} follow-ons)" in text.splitlines()[0]
    assert f"+{len(fs) - 1} follow-on findings: gradients (eager), forward ({COMPILE})" in text
    assert "[1/" not in text  # one root: no numbering of several


def test_cli_folds_the_second_mode_under_the_eager_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wrong_fwd.py").write_text(WRONG_FORWARD)
    code, out = _cli("check", "wrong_fwd.py", "--modes", f"eager,{COMPILE}",
                     "--max-examples", "4", "--seed", "3", "--json", "r.json")
    assert code == 1
    doc = json.loads((tmp_path / "r.json").read_text())
    eager, compiled = doc["results"]
    assert eager["findings"][0]["check"] == "forward"
    assert eager["findings"][0]["caused_by"] is None
    root = {"result": 0, "finding": 0}
    assert all(f["caused_by"] == root for f in eager["findings"][1:] + compiled["findings"])
    assert "+1 follow-on finding" not in out
    assert f"follow-on findings: gradients (eager), forward ({COMPILE})" in out
    assert "a consequence of forward (eager): OutputMismatch" in out
    section = out.split(f"[{COMPILE}-cpu] ==")[1]
    assert "only follow-on findings" in section.splitlines()[1]


def test_two_independent_bugs_are_two_roots():
    def ref(x, y):
        return x * 2

    @equivalent_to(ref)
    def both(x, y):
        with torch.no_grad():
            y.add_(1)  # undeclared mutation of y
        return x * 2.01  # and a wrong forward

    report = equiv.check(both, max_examples=5, seed=3, raise_on_failure=False)
    roots = [(f.check, f.argument) for f in report.roots()]
    assert roots == [("forward", "output"), ("mutation", "y")]
    grads = [f for f in report.findings if f.check == "gradients"]
    assert grads and all(report.findings[f.caused_by].check == "forward" for f in grads)
    assert report.headline().split(": ")[2].startswith("2 findings (+")


class _WrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b * 3, g * a  # bug: the gradient of a is 3x


def _ref_mul(a, b):
    return a * b


def test_wrong_backward_only_roots_at_gradients():
    @equivalent_to(_ref_mul)
    def mul(a, b):
        return _WrongBackward.apply(a, b)

    report = equiv.check(mul, modes=("eager",), max_examples=5, seed=3, raise_on_failure=False)
    fs = report.findings
    assert (fs[0].check, fs[0].argument, fs[0].caused_by) == ("gradients", "a", None)
    assert "double-backward" in {f.check for f in fs[1:]}
    assert all(f.caused_by == 0 for f in fs[1:])
    assert "+1 follow-on finding: double-backward (eager)" in report.render()


def _f(check, mode="eager", example="k(x=f32[2])", argument="x", attribution=None):
    return Finding(check=check, headline=f"{check} differs", mode=mode, example=example,
                   argument=argument, attribution=attribution)


def test_attribution_rules_on_plain_data():
    from equiv._roots import EAGER_TOO, causes

    eager_too = f"{EAGER_TOO}: not specific to {COMPILE}."
    fs = [_f("gradients"), _f("repeated-backward"), _f("needs-input-grad", argument="y"),
          _f("double-backward", argument="y"), _f("repeated-backward", argument="y"),
          _f("gradients", example="k(x=f32[3])"),  # another example: unsure, a root
          _f("gradients", mode=COMPILE, example="k(x=f32[4])", attribution=eager_too),
          _f("gradients", mode=COMPILE, example="k(x=f32[5])",
             attribution="only the implementation under compile diverges"),
          _f("mutation", argument="y"), _f("schedule"), _f("flaky")]
    assert causes(fs) == [None, 0, 0, 0, None, None, 0, None, None, None, None]
    forward = [_f("forward", argument="output"), _f("mutation", argument="y"), _f("gradients"),
               _f("forward", mode=COMPILE, example="k(x=f32[9])", argument="output",
                  attribution=eager_too),
               _f("gradients", mode=COMPILE, example="k(x=f32[9])")]
    assert causes(forward) == [None, None, 0, 0, 0]
    # a mutation beside a wrong gradient is two bugs (x.detach().add_() and a cut gradient)
    assert causes([_f("mutation"), _f("gradients")]) == [None, None]


# -- numbers printed as what they are -------------------------------------------------------
def test_nan_is_printed_as_nan_not_as_a_huge_ulp_distance():
    actual = torch.tensor([float("nan"), 4.0])
    m = judge(actual, torch.tensor([2.0, 4.0], dtype=torch.float64), torch.tensor([2.0, 4.0]))
    assert "implementation max error NaN" in m.message
    assert "1.8e+308" not in m.message and "ulps): max inf" not in m.message
    f = Finding(check="forward", headline="h", rule="baseline", impl_error=math.inf, k=2.0,
                baseline_error=0.0, allowed=1e-5, dtype="torch.float32")
    assert "implementation error inf" not in f.render()


def test_no_ulp_distance_against_an_exact_zero():
    m = judge(torch.tensor([0.25, 0.0]), torch.zeros(2, dtype=torch.float64), torch.zeros(2))
    assert "e+44" not in m.message and "e+45" not in m.message
    assert "where float64 is exactly 0" in m.message


# -- the CLI's notes, whole ------------------------------------------------------------------
def test_not_compared_line_is_not_truncated(tmp_path, monkeypatch):
    import equiv._results as results

    note = "gradients not compared: " + " ".join(f"word{i}" for i in range(80)) + " THE-END"

    def fake_run_one(spec, mode, device, **_):
        report = Report(spec=spec.name, implementation=spec.implementation,
                        reference=spec.reference, notes=(note,))
        return results.Result(spec=spec.name, implementation=spec.implementation,
                              reference=spec.reference, mode=str(mode), device=device,
                              verdict="pass", report=report)

    monkeypatch.setattr(results, "run_one", fake_run_one)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "noted_fwd.py").write_text(WRONG_FORWARD)
    code, out = _cli("check", "noted_fwd.py", "--modes", "eager")
    assert code == 0, out
    assert f"not compared: noted_fwd.scale [eager-cpu]: {note}\n" in out


# -- a module reproduction that runs ----------------------------------------------------------
FUSED = textwrap.dedent('''
    import torch
    from torch import nn
    from equiv import equivalent_to

    class ThreeProj(nn.Module):
        def __init__(self, dim, dtype=None):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(dim, dim, dtype=dtype) for _ in range(3))

        def forward(self, x):
            return self.q(x), self.k(x), self.v(x)

    def qkv_state(sd):
        return {"qkv.weight": torch.cat([sd["q.weight"], sd["k.weight"], sd["v.weight"]]),
                "qkv.bias": torch.cat([sd["q.bias"], sd["k.bias"], sd["v.bias"]])}

    @equivalent_to(ThreeProj, init=dict(dim=3, dtype=torch.float64), state_map=qkv_state,
                   input_shapes=(..., 3))
    class FusedQKV(nn.Module):
        def __init__(self, dim, dtype=None):
            super().__init__()
            self.dim = dim
            self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)

        def forward(self, x):  # bug: splits the fused rows as (dim, 3)
            y = self.qkv(x).unflatten(-1, (self.dim, 3)).movedim(-1, 0)
            return y[0], y[1], y[2]
''')


def test_module_reproduction_with_state_map_runs_and_fails(tmp_path, monkeypatch):
    (tmp_path / "fused_qkv.py").write_text(FUSED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fused_qkv

    report = equiv.check(fused_qkv.FusedQKV, max_examples=3, seed=3, checks=("forward",),
                         raise_on_failure=False)
    code = report.findings[0].example_code
    assert "from fused_qkv import qkv_state" in code
    assert code.splitlines()[-1].startswith("equiv.assert_equivalent(FusedQKV, x, params=")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.returncode != 0, code
    finding = report.findings[0]
    assert f"{finding.kind}: {finding.headline}" in done.stderr, done.stderr[-2000:]
