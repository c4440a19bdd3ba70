"""A run you can trust (part two): user code cannot reach later specs or equiv's comparisons,
a forked child never reports, ``EQUIV_PROFILE`` is resolved after the targets load, time is
bounded (``--timeout``, the ci profile's limit, a Hypothesis ``deadline``), a crashed xdist
worker's item is in the report, and a compile mode that ran nothing in a graph is not
compiled. Every probe of user code runs in a subprocess, through the public CLI or plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv.strategies import tensors

HEAD = """\
import os, sys, time, warnings
import torch, torch.testing
import hypothesis, hypothesis.strategies as st
import equiv
from equiv import equivalent_to
from equiv.strategies import tensors

def vec(dtype=torch.float32):
    return st.tuples(tensors(shape=(3,), dtype=dtype))
"""

QUICK = ["--modes", "eager", "--max-examples", "3", "--seed", "1"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "EQUIV_PROFILE")}
    env.update(extra)
    return env


def equiv_check(tmp_path: Path, body: str, *args: str, env: dict[str, str] | None = None,
                timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``equiv check specs_probe.py ARGS --json r.json`` in a subprocess: (process, report)."""
    (tmp_path / "specs_probe.py").write_text(HEAD + textwrap.dedent(body))
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "equiv", "check", "specs_probe.py", *args,
                           "--json", str(report)], cwd=tmp_path, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)
    doc = json.loads(report.read_text()) if report.exists() else None
    return proc, doc


def verdicts(doc: dict) -> dict[str, str]:
    return {r["spec"].rsplit(".", 1)[1]: r["verdict"] for r in doc["results"]}


# -- isolation ----------------------------------------------------------------------------------
LEAKS = """
def double(x): return x * 2
def plus_one(x): return x + 1
def warns(x):
    warnings.warn("harmless", UserWarning)
    return x + 1

@equivalent_to(double, inputs=vec())
def a_warnings(x):
    warnings.simplefilter("error")          # a filter left behind
    return x * 2

@equivalent_to(double, inputs=vec())
def a_comparisons(x):
    torch.equal = lambda a, b: True         # equiv's comparisons replaced
    torch.testing.assert_close = lambda *a, **k: None
    return x * 2

@equivalent_to(double)
def a_hooks(x: torch.Tensor) -> torch.Tensor:
    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t).__enter__()
    return x * 2

@equivalent_to(double, inputs=vec())
def a_cwd(x):
    os.chdir("/")
    return x * 2

@equivalent_to(double, inputs=vec())
def a_recursion(x):
    sys.setrecursionlimit(30)
    return x * 2

@equivalent_to(warns, inputs=vec())
def v_warnings(x):                          # correct: the reference's warning is no error
    return x + 1

@equivalent_to(plus_one, inputs=vec())
def v_comparisons(x):                       # wrong: must fail
    return x + 2

def exp(x): return x.exp()
@equivalent_to(exp)
def v_hooks(x: torch.Tensor) -> torch.Tensor:   # correct: its saves keep the version check
    return x.exp()

@equivalent_to(plus_one, inputs=vec())
def v_cwd(x):                               # correct, as long as it runs where it started
    assert os.getcwd() != "/", "the working directory leaked from another spec"
    return x + 1

@equivalent_to(plus_one, inputs=vec())
def v_recursion(x):                         # correct
    return x + 1
"""


def test_user_code_cannot_reach_later_specs(tmp_path):
    """Warnings filters, replaced torch.equal/assert_close, an entered saved_tensors_hooks
    context, a changed working directory and recursion limit are restored after each call of
    user code: the later correct specs pass and the wrong one fails."""
    proc, doc = equiv_check(tmp_path, LEAKS, *QUICK)
    assert doc is not None, proc.stderr[-3000:]
    got = verdicts(doc)
    assert got["v_comparisons"] == "fail", proc.stdout[-3000:]
    for name in ("v_warnings", "v_hooks", "v_cwd", "v_recursion"):
        assert got[name] == "pass", (name, proc.stdout[-4000:])
    for name in ("a_warnings", "a_comparisons", "a_cwd"):  # leaking is not wrong in itself
        assert got[name] == "pass", (name, proc.stdout[-4000:])
    assert (tmp_path / "r.json").exists()  # written where the run started, not in "/"
    assert proc.returncode == 1


def test_a_forked_child_never_reports(tmp_path):
    proc, doc = equiv_check(tmp_path, """
        def double(x): return x * 2
        FORKED = []

        @equivalent_to(double, inputs=vec())
        def forks(x):
            if not FORKED:
                FORKED.append(os.fork())
            return x * 2
        """, *QUICK)
    time.sleep(0.5)  # a child still running would print after the parent
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    header = [line for line in proc.stdout.splitlines() if line.startswith("spec ")]
    assert len(header) == 1, proc.stdout   # one table: one process reported
    assert proc.stdout.count("1 pass") == 1, proc.stdout
    assert verdicts(doc) == {"forks": "pass"}


# -- EQUIV_PROFILE ------------------------------------------------------------------------------
def test_an_unknown_environment_profile_is_a_clear_usage_error(tmp_path):
    proc, doc = equiv_check(tmp_path, """
        def double(x): return x * 2
        @equivalent_to(double, inputs=vec())
        def fine(x): return x * 2
        """, *QUICK, env=_env(EQUIV_PROFILE="nope"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "EQUIV_PROFILE='nope' names no equiv settings profile" in proc.stderr
    assert "['ci', 'default', 'thorough']" in proc.stderr
    assert doc is None
    imported = subprocess.run([sys.executable, "-c", "import equiv"], env=_env(
        EQUIV_PROFILE="nope"), capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-2000:]


def test_the_environment_profile_may_be_one_a_target_registers(tmp_path):
    proc, doc = equiv_check(tmp_path, """
        equiv.settings.register_profile("mine", max_examples=2, modes=("eager",))
        def double(x): return x * 2
        @equivalent_to(double, inputs=vec())
        def fine(x): return x * 2
        """, env=_env(EQUIV_PROFILE="mine"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "profile=mine modes=eager devices=cpu max_examples=2" in proc.stdout
    assert doc["profile"] == "mine"


def test_pytest_reports_an_unknown_environment_profile_as_a_usage_error(tmp_path):
    (tmp_path / "specs_probe.py").write_text(HEAD + textwrap.dedent("""
        def double(x): return x * 2
        @equivalent_to(double, inputs=vec())
        def fine(x): return x * 2
        """))
    (tmp_path / "test_probe.py").write_text(
        "import specs_probe\nfrom equiv.pytest import tests_for\n"
        "test_fine = tests_for(specs_probe.fine)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "test_probe.py", "--equiv-modes=eager"],
                          cwd=tmp_path,
                          env=_env(EQUIV_PROFILE="nope"), capture_output=True, text=True,
                          timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-3000:]  # pytest's usage-error status
    assert "INTERNALERROR" not in text
    assert "EQUIV_PROFILE='nope' names no equiv settings profile" in text


# -- time ---------------------------------------------------------------------------------------
def test_a_hypothesis_deadline_and_a_hang_are_timeouts(tmp_path):
    """The user's Hypothesis deadline is a TIMEOUT finding (exit 1), not an error; a kernel
    that never returns ends with TIMEOUT under --timeout, in bounded time."""
    start = time.monotonic()
    proc, doc = equiv_check(tmp_path, """
        def plus_one(x): return x + 1

        @equivalent_to(plus_one, inputs=vec(), settings=equiv.settings(
            timeout=60, hypothesis_settings=hypothesis.settings(deadline=20)))
        def sleepy(x):
            time.sleep(0.04)
            return x + 1

        @equivalent_to(plus_one, inputs=vec())
        def hangs(x):
            while True:
                time.sleep(0.05)
        """, *QUICK, "--timeout", "2", timeout=300)
    assert time.monotonic() - start < 240
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = {r["spec"].rsplit(".", 1)[1]: r for r in doc["results"]}
    assert rows["sleepy"]["verdict"] == "fail"
    assert rows["sleepy"]["reason"].startswith("TIMEOUT:"), rows["sleepy"]["reason"]
    assert "Hypothesis deadline=20ms" in rows["sleepy"]["reason"]
    assert "please report a bug" not in proc.stdout
    assert rows["hangs"]["reason"].startswith("TIMEOUT:"), rows["hangs"]["reason"]
    assert "longer than timeout=2s" in rows["hangs"]["reason"]
    assert "--timeout=2" in proc.stdout  # the reproduce line keeps the limit


def test_the_ci_profile_limits_each_example():
    assert equiv.settings.get_profile("ci").timeout == 300
    assert equiv.settings.get_profile("default").timeout is None


def test_pytest_equiv_timeout_ends_a_hang(tmp_path):
    (tmp_path / "specs_probe.py").write_text(HEAD + textwrap.dedent("""
        def plus_one(x): return x + 1
        @equivalent_to(plus_one, inputs=vec())
        def hangs(x):
            while True:
                time.sleep(0.05)
        """))
    (tmp_path / "test_probe.py").write_text(
        "import specs_probe\nfrom equiv.pytest import tests_for\n"
        "test_hangs = tests_for(specs_probe.hangs)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "test_probe.py", "--equiv-modes=eager",
                           "--equiv-timeout=1.5", "--equiv-max-examples=2"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "an example ran longer than timeout=1.5s" in proc.stdout
    assert "--equiv-timeout=1.5" in proc.stdout  # in the reproduce line


# -- memory on the failure path ----------------------------------------------------------------
def test_shrinking_keeps_no_copy_of_past_examples(tmp_path):
    """While Hypothesis shrinks a failure, the examples it already ran are freed: at most one
    drawn example is alive when the implementation runs (bench/failure_memory.py measures the
    peak at 1e7 elements)."""
    script = tmp_path / "probe.py"
    script.write_text(HEAD + textwrap.dedent("""
        import gc, weakref
        DRAWN, ALIVE = [], []
        def remember(args):
            DRAWN.append(weakref.ref(args[0]))
            return args
        def ref(x): return x * 2 + 1
        @equivalent_to(ref, inputs=vec().map(remember))
        def kernel(x):
            gc.collect()
            ALIVE.append(sum(r() is not None for r in DRAWN))
            return x * 2 + 1.001
        report = equiv.check(kernel, modes=("eager",), seed=0, max_examples=20,
                             raise_on_failure=False, settings=equiv.settings(
                                 hypothesis_settings=hypothesis.settings(database=None)))
        print("RESULT", report.ok, len(DRAWN), max(ALIVE))
        """))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    ok, drawn, alive = line[0].split()[1:]
    assert ok == "False" and int(drawn) >= 3, line
    assert int(alive) <= 1, line


def test_a_failure_is_explained_once_not_per_shrink_step(monkeypatch):
    """Searching and shrinking a failure only judges each example: the numbers of a numeric
    mismatch beyond its verdict and the timeline replay are computed once, for the minimal
    example that is reported (the attribution replay judges it again, unexplained)."""
    from equiv import numerics
    from equiv.execution import script
    explained: list[str] = []
    zero, replay = numerics._zero_oracle, script._replay_backwards
    monkeypatch.setattr(numerics, "_zero_oracle",
                        lambda *a: explained.append("numbers") or zero(*a))
    monkeypatch.setattr(script, "_replay_backwards",
                        lambda *a: explained.append("timeline") or replay(*a))
    calls: list[int] = []

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2.01  # wrong: every example fails the gradient check

    def double(x):
        return x * 2

    @equiv.equivalent_to(double, inputs=st.integers(1, 40).flatmap(lambda n: st.tuples(
        tensors(shape=(n,), dtype=torch.float32, requires_grad=True))))
    def scaled(x):
        calls.append(x.numel())
        return Scaled.apply(x)

    report = equiv.check(scaled, modes=("eager",), seed=0, max_examples=8,
                         raise_on_failure=False, settings=equiv.settings(
                             hypothesis_settings=hypothesis.settings(database=None)))
    assert [f.check for f in report.findings] == ["gradients"], report
    assert "ULP distance from float64" in report.findings[0].details, report
    assert len(set(calls)) >= 3, calls  # several examples failed while searching and shrinking
    assert explained.count("numbers") == 1 and explained.count("timeline") == 1, explained


def test_searching_stops_at_the_first_finding_and_keeps_one_example(monkeypatch):
    """While Hypothesis searches and shrinks, an example's checks stop at its first finding
    (its verdict is that check alone) and the values a printed reproduction loads from a
    ``.pt`` file are kept for one example per check, the reported one; the report still
    names the forward mismatch with its reproduction."""
    from equiv.checks import gradients
    from equiv.run import _ModeDriver
    graded: list[int] = []
    kept: list[int] = []
    run, described = gradients.run, _ModeDriver._described
    monkeypatch.setattr(gradients, "run", lambda ex, sink: graded.append(1) or run(ex, sink))

    def counting(self, *a, **k):
        out = described(self, *a, **k)
        kept.append(sum(len(v) for v in self.files.values()))
        return out
    monkeypatch.setattr(_ModeDriver, "_described", counting)

    def ref(x):
        return x * 2

    @equiv.equivalent_to(ref, inputs=st.tuples(tensors(shape=(4100,), dtype=torch.float32,
                                                       requires_grad=True)))
    def off(x):
        return x * 2 + 0.5  # wrong on every example

    report = equiv.check(off, modes=("eager",), seed=0, max_examples=6,
                         raise_on_failure=False, settings=equiv.settings(
                             hypothesis_settings=hypothesis.settings(database=None)))
    assert [f.check for f in report.findings] == ["forward"], report
    assert ".pt" in report.findings[0].example_code, report.findings[0].example_code
    assert report.examples_run >= 4, report.examples_run
    assert len(graded) <= 2, graded  # the reported example and its attribution replay
    assert len(kept) >= 4 and max(kept) <= 1, kept
    note = next(n for n in report.notes if "costly checks" in n)  # said only where they ran
    ran = int(note.split(" ran on ")[1].split(" of ")[0])
    assert ran < report.examples_run, (note, report.examples_run)


# -- compile honesty ----------------------------------------------------------------------------
def test_a_compiler_disabled_implementation_is_not_compiled(tmp_path):
    proc, doc = equiv_check(tmp_path, """
        def sine(x): return x.sin()

        @equivalent_to(sine)
        @torch.compiler.disable
        def disabled(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        @equivalent_to(sine)
        def compiles(x: torch.Tensor) -> torch.Tensor:
            return x.sin()
        """, "--modes", "compile[aot_eager]", "--max-examples", "2", "--seed", "1")
    assert doc is not None, proc.stderr[-3000:]
    assert verdicts(doc) == {"disabled": "not-compiled", "compiles": "pass"}, proc.stdout
    assert "compilations of the implementation" not in proc.stdout.split("disabled")[1][:300]
    assert "Dynamo captured no graph of the implementation" in proc.stdout
    assert proc.returncode == 1


# -- xdist --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_crashed_xdist_worker_item_is_an_error_row(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "specs_probe.py").write_text(HEAD + textwrap.dedent("""
        def plus_one(x): return x + 1
        @equivalent_to(plus_one, inputs=vec())
        def fine(x): return x + 1
        @equivalent_to(plus_one, inputs=vec())
        def exits(x): os._exit(3)
        @equivalent_to(plus_one, inputs=vec())
        def killed(x): os.kill(os.getpid(), 9)
        """))
    (tmp_path / "test_probe.py").write_text(
        "import specs_probe\nfrom equiv.pytest import tests_for\n"
        "test_all = tests_for(specs_probe)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "1", "test_probe.py", "--equiv-modes=eager",
                           "--equiv-max-examples=2", "--equiv-report=r.json"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:]
    rows = {r["spec"].rsplit(".", 1)[1]: r for r in
            json.loads((tmp_path / "r.json").read_text())["results"]}
    assert set(rows) == {"fine", "exits", "killed"}, rows
    assert rows["fine"]["verdict"] == "pass"
    for name in ("exits", "killed"):
        assert rows[name]["verdict"] == "error"
        assert "crashed while running" in rows[name]["reason"]
        assert f"test_probe.py::{name}[eager-cpu]" in rows[name]["reason"]
        assert rows[name]["mode"] == "eager" and rows[name]["device"] == "cpu"


def test_a_default_device_set_by_user_code_is_restored():
    """``torch.set_default_device`` in user code is undone after the call; a device context
    the caller entered is kept (the cheap default-device test sees both)."""
    import torch

    from equiv.execution.calls import isolated

    try:
        with isolated():
            torch.set_default_device("meta")
        assert torch.get_default_device() == torch.device("cpu")
        assert torch.empty(1).device.type == "cpu"
        torch.set_default_device(None)
        with torch.device("meta"):
            with isolated():
                assert torch.empty(1).device.type == "meta"
            assert torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_device(None)
    assert torch.empty(1).device.type == "cpu"


SAME_SEED = """\
import importlib, json, sys
import hypothesis, torch
import equiv

drawn = []

def double_ref(x, y):
    return x * 2 + y

@equiv.equivalent_to(double_ref)
def double(x, y):
    drawn.append([list(x.shape), list(y.shape), str(x.dtype), x.detach().double().sum().item()])
    return x * 2 + y

def run():
    drawn.clear()  # the forward check alone calls the implementation once per example
    cfg = equiv.settings(seed=1, max_examples=30, modes=("eager",), checks=("forward",),
                         hypothesis_settings=hypothesis.settings(database=None))
    report = equiv.check(double, settings=cfg, raise_on_failure=False)
    return [report.examples_run, [f.check for f in report.findings], list(drawn)]

first = run()
importlib.import_module("kernel_sizes")  # a module of the user's with its own constants
print(json.dumps([first, run()]))
"""


def test_the_same_seed_draws_the_same_examples_whatever_was_imported(tmp_path):
    """A seeded run draws the same examples before and after the process imported a module
    of the user's with constants of its own (Hypothesis draws some values from the literals
    of the modules imported so far; equiv's runs draw from none)."""
    (tmp_path / "kernel_sizes.py").write_text(
        "BLOCKS = (%s)\nSCALES = (%s)\n" % (", ".join(str(7 + 13 * i) for i in range(60)),
                                            ", ".join(f"{0.37 + i:.2f}" for i in range(30))))
    (tmp_path / "same_seed.py").write_text(SAME_SEED)
    proc = subprocess.run([sys.executable, "same_seed.py"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, again = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first[0] >= 25 and first[1] == [], first
    assert again == first
