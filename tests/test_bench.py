"""The benchmark scripts run (tiny sizes) so they cannot rot."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors

from tests.conftest import FAST

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
MODULES = ("overhead", "growth", "versus", "first_failure", "strategies_bench", "recorder_bench",
           "functions", "modes_bench", "walltime", "rows", "realcode",
           "failure_memory", "peer")


@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "bench/run.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_run_quick_out_writes_the_file(tmp_path):
    # --out on the command line used to reach a sub-bench's own argv parser and crash it
    out = tmp_path / "results.md"
    _run("--quick", "--only", "overhead,growth,versus,first_failure,compile_counts", "--out",
         str(out))
    text = out.read_text()
    for title in ("## Overhead", "## Growth", "## Versus gradcheck", "## Time to first failure",
                  "## Compilations"):
        assert title in text
    assert "## Wall time" not in text  # --only left it out
    assert "| wrong backward formula | caught" in text
    for case in ("relu_ (in place)", "rms_norm", "custom Function (scaled tanh)"):
        assert f"| {case} | 100 | 3 |" in text
    assert "1 interleaved rounds" in text


@pytest.mark.slow
def test_run_quick_every_section(tmp_path):
    out = tmp_path / "results.md"
    _run("--quick", "--out", str(out))
    text = out.read_text()
    for title in ("## Strategies", "## Recorder overhead", "## Function checks", "## Modes",
                  "## Wall time"):
        assert title in text
    assert "| `python -m equiv check examples/x_squared_lab.py" in text
    assert "(test suite not timed: pass `--suite`)" in text


@pytest.mark.parametrize("module", MODULES)
def test_modules_read_argv_only_in_main(module, bench_path, monkeypatch, capsys):
    # bench() takes its parameters as arguments; main(argv) parses the argv it is given,
    # never sys.argv (which holds run.py's own options)
    monkeypatch.setattr(sys, "argv", ["bench/run.py", "--out", "/nonexistent/x.md"])
    mod = importlib.import_module(module)
    assert callable(mod.bench)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_walltime_compares_workers_with_one_process(bench_path, tmp_path):
    walltime = importlib.import_module("walltime")
    table = walltime.workers(2, runs=1, quick=True, out=tmp_path)
    assert "| 1 |" in table and "| yes |" in table and "median speedup" in table


def test_walltime_times_a_subprocess_and_reports_a_crash(bench_path):
    walltime = importlib.import_module("walltime")
    median, best, rc = walltime.timed(("-c", "pass"), 2)
    assert 0 < best <= median and rc == 0
    assert walltime.timed(("-c", "raise SystemExit(1)"), 1)[2] == 1  # a finding is reported
    with pytest.raises(RuntimeError, match="exited 3"):
        walltime.timed(("-c", "raise SystemExit(3)"), 1)


def test_overhead_cases_raw_matches_the_reference(bench_path):
    overhead = importlib.import_module("overhead")
    strategy = overhead._inputs(2, (3, 4))
    examples = overhead.draw_examples(strategy, 4)
    assert len(examples) == 4 and all(ex[0].shape == (3, 4) and ex[1].shape == (4,)
                                      for ex in examples)
    assert not any(t.requires_grad for ex in examples for t in ex)
    for case in overhead.CASES:
        ex = examples[0][:case.arity]
        before = [t.clone() for t in ex]
        torch.testing.assert_close(case.call(*[t.clone() for t in ex]), case.ref(*ex))
        assert overhead.raw_time(case, [ex]) > 0
        assert all(torch.equal(a, b) for a, b in zip(ex, before))  # raw never mutates examples


class _ScaledTanhWrongBackward(torch.autograd.Function):
    """The benchmark's Function with the derivative of tanh, not of 2 * tanh."""

    @staticmethod
    def forward(ctx, x):
        y = 2.0 * torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1.0 - 0.25 * y * y)


def test_benchmarked_function_is_correct_and_its_bug_is_caught(bench_path):
    functions = importlib.import_module("functions")
    inputs = st.tuples(tensors(shape=(3, 4), dtype=torch.float32, requires_grad=True))
    right = equivalent_to(functions.scaled_tanh_ref, inputs=inputs,
                          name="test_bench.scaled_tanh")(functions.ScaledTanh)
    assert equiv.check(right, settings=FAST).ok
    wrong = equivalent_to(functions.scaled_tanh_ref, inputs=inputs,
                          name="test_bench.scaled_tanh_wrong")(_ScaledTanhWrongBackward)
    with pytest.raises(equiv.GradientMismatch) as exc:
        equiv.check(wrong, settings=FAST)
    found = [f for f in exc.value.report.findings if f.check == "gradients"]
    assert found and "gradient w.r.t. 'x' differs from the reference" in found[0].headline


def test_rows_times_every_check_and_restores_the_catalog(bench_path):
    import equiv.pipeline as pipeline

    rows = importlib.import_module("rows")
    before = dict(pipeline._MODULES)
    table = rows.bench(0, 100, 3)
    assert "| gradients |" in table and "| repeated-backward |" in table
    assert pipeline._MODULES == before


def test_realcode_rows_pass_fail_and_flag_unclassified(bench_path, tmp_path):
    realcode = importlib.import_module("realcode")
    labels = [p.label for p in realcode.pairs()]
    assert len(labels) >= 40 and len(set(labels)) == len(labels)
    out = tmp_path / "rows.json"
    table = realcode.bench(examples=3, only=("relu_", "mse_loss"), json_path=str(out))
    assert "| relu_ | _refs | pass |" in table and "2 pass, 0 FAIL, 0 ERROR" in table
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["pass", "pass"]
    wrong = realcode.Pair("wrong_relu_", lambda x: x.relu_().mul_(1.5),
                          lambda x: torch.relu(x), {"x": "out"}, source="torch")
    row = realcode.run_pair(wrong, 5, ("eager",), 0)
    assert row["status"] == "FAIL" and row["known"] == "unclassified"
    assert any(f["check"] == "forward" for f in row["findings"])
    assert realcode.classify("pad", [{"check": "gradients"}]) == "real"
    assert realcode.classify("batch_norm_eval", [{"check": "gradients"},
                                                 {"check": "error-parity"}]) == "real + false alarm"
    assert realcode.classify("pad", [{"check": "forward"}]) == "unclassified"


def test_peer_test_passes_the_cases_and_catches_a_wrong_kernel(bench_path):
    """The hand-written test bench/peer.py times is a real test: it passes the three kernels
    and fails a relu_ that clamps at the wrong bound; ``--floor`` adds a column per row."""
    import dataclasses
    import re

    overhead, peer = importlib.import_module("overhead"), importlib.import_module("peer")
    for case in overhead.CASES:
        peer.peer_test(case, overhead._inputs(case.arity, (2, 10)), 3)()
    wrong = dataclasses.replace(overhead.CASES[0], call=lambda x: x.clamp_(min=0.5))
    with pytest.raises(AssertionError):
        peer.peer_test(wrong, overhead._inputs(1, (2, 10)), 10)()
    table = peer.bench(examples=2, sizes=(1000,), rounds=1, floor=True)
    assert "equiv floor/peer" in table
    for case in overhead.CASES:
        assert re.search(rf"\| {re.escape(case.label)} \| 1,000 \| .*x \| [0-9.]+x \|$", table,
                         re.M), table


def test_peer_traffic_counts_the_copies_and_comparisons_of_a_check(bench_path):
    """``--traffic``: the elements check() copies and compares, by op (every side is a copy of
    the drawn values; the mutation and purity checks compare them)."""
    import re

    overhead, peer = importlib.import_module("overhead"), importlib.import_module("peer")
    case = overhead.CASES[0]
    fn = overhead.equivalent_to(case.ref, mutates=case.mutates, name="bench.peer.traffic",
                                inputs=overhead._inputs(1, (2, 10)))(case.impl)
    line = peer.traffic(fn, 2)
    for op in ("clone", "equal"):
        assert re.search(rf"\b{op} [1-9]\d* calls \d+\.\dM", line), line
    assert line.startswith("all ")
