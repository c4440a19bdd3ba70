"""The equiv command: exit status, summary table, findings, import errors, reports."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from equiv.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = str(ROOT / "examples")
FAILING = str(ROOT / "examples" / "failing")
# mechanics tests pin the mode (compile modes have their own tests in test_modes.py)
QUICK = ["--modes", "eager", "--max-examples", "4", "--seed", "7"]


@pytest.fixture(autouse=True)
def _default_profile(monkeypatch):
    """These tests state the default profile's output: CI=1 or EQUIV_PROFILE in the
    environment (which select other profiles) must not leak in, here or in subprocesses."""
    import equiv

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("EQUIV_PROFILE", raising=False)
    previous = equiv.settings._push_session("default")
    yield
    equiv.settings._pop_session(previous)


def rows(out: str) -> dict[tuple[str, str, str], list[str]]:
    """The summary table as {(spec, mode, device): [verdict, examples, findings]}."""
    table = {}
    for line in out.splitlines():
        cells = line.split("  ")
        cells = [c.strip() for c in cells if c.strip()]
        if len(cells) == 6 and cells[0] != "spec" and not set(cells[0]) <= {"-"}:
            table[tuple(cells[:3])] = cells[3:]
    return table


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


BUGGY = textwrap.dedent('''
    import torch
    from equiv import equivalent_to

    def double_ref(x):
        return x * 2

    @equivalent_to(double_ref, mutates={"x": "out"})
    def double_(x):
        """Bug: forgets to double the last element."""
        x[:-1].mul_(2)
        return x
''')


def test_shipped_examples_pass_with_exit_0_and_a_summary_table():
    """equiv check examples/ prints the header, one table row per spec x mode x device, exit 0."""
    code, out, err = run("check", EXAMPLES, *QUICK)
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0] == ("equiv: profile=default modes=eager devices=cpu max_examples=4 "
                        "--seed=7")
    assert lines[1].split() == ["spec", "mode", "device", "verdict", "examples", "findings"]
    table = rows(out)
    assert table[("activations.relu_", "eager", "cpu")] == ["pass", "4", "0"]
    assert table[("activations.leaky_relu_", "eager", "cpu")] == ["pass", "4", "0"]
    assert {v[0] for v in table.values()} == {"pass"}
    assert lines[-1] == f"{len(table)} pass"


def test_failing_examples_exit_1_with_the_finding_in_full():
    """equiv check examples/failing/ exits 1, marks FAIL in the table, prints each finding."""
    code, out, _ = run("check", FAILING, *QUICK)
    assert code == 1
    table = rows(out)
    assert table[("buggy_kernels.scale_stale", "eager", "cpu")][0] == "FAIL"
    assert {v[0] for v in table.values()} == {"FAIL"}  # every kernel there is buggy
    assert "== FAIL: buggy_kernels.scale_stale [eager-cpu] ==" in out
    assert "MutationMismatch: argument 'w' was modified, but the contract does not declare " \
           "it as mutated." in out
    assert "GradientMismatch: gradient w.r.t. 'x' differs from the reference" in out
    assert "Minimal failing example:\n  scale_stale(x=f32[" in out
    assert out.rstrip().endswith(
        f"{len(table)} FAIL\nReproduce: equiv check {FAILING} --profile=default --modes=eager "
        "--devices=cpu --max-examples=4 --seed=7")


def test_a_buggy_kernel_file_exits_1_naming_check_argument_and_numbers(tmp_path):
    """A new buggy module is caught: exit 1, the mutation finding with its numbers."""
    f = tmp_path / "buggy_double.py"
    f.write_text(BUGGY)
    code, out, _ = run("check", str(f), *QUICK)
    assert code == 1, out
    assert "buggy_double.double_  eager  cpu     FAIL" in out
    assert "MutationMismatch: the final value of mutated argument 'x' differs from the " \
           "reference." in out
    assert "  mode: eager   device: cpu   dtype: torch.float32   check: mutation" in out
    assert "Greatest absolute difference:" in out


def test_a_file_that_fails_to_import_exits_2_with_its_traceback(tmp_path):
    """An import error is exit 2 with the module's own traceback on stderr."""
    f = tmp_path / "broken_kernels.py"
    f.write_text("import torch\n\nraise ValueError('broken on purpose')\n")
    code, out, err = run("check", str(f))
    assert code == 2 and out == ""
    assert err.startswith(f"equiv: could not import {f}:\nTraceback (most recent call last):")
    assert f'File "{f}", line 3, in <module>' in err
    assert err.rstrip().endswith("ValueError: broken on purpose")


def test_a_registration_error_at_import_exits_2(tmp_path):
    """A spec whose contract is wrong fails at decoration time, so at import: exit 2."""
    f = tmp_path / "bad_contract.py"
    f.write_text(textwrap.dedent('''
        from equiv import equivalent_to

        def ref(x):
            return x

        @equivalent_to(ref, mutates={"nope": "out"})
        def impl(x):
            return x
    '''))
    code, _, err = run("check", str(f))
    assert code == 2
    assert "InvalidArgument" in err and "nope" in err


@pytest.mark.parametrize("argv, message", [
    (["check", "no_such_module_xyz"], "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    (["check", EXAMPLES, "--profile", "nope"], "equiv: no equiv settings profile named 'nope'"),
])
def test_usage_errors_exit_2(argv, message):
    """A missing module or unknown profile is exit 2 with a message naming it."""
    code, _, err = run(*argv)
    assert code == 2
    assert message in err


def test_no_specs_found_exits_2(tmp_path):
    """A target without @equivalent_to specs is a usage error, not a silent pass."""
    (tmp_path / "plain.py").write_text("x = 1\n")
    code, _, err = run("check", str(tmp_path / "plain.py"))
    assert code == 2
    assert "no specs found" in err and "@equivalent_to" in err


def test_bad_option_values_exit_2_naming_the_option(capsys):
    """argparse rejects a non-positive --max-examples and an empty mode entry."""
    for argv in (["check", EXAMPLES, "--max-examples", "0"], ["check", EXAMPLES, "--modes", ","]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-examples: '0': give a positive integer" in err
    assert "argument --modes: ',': give a comma-separated list" in err


def test_unknown_mode_is_an_error_row_and_exit_2():
    """A mode the runner does not know shows ERROR with the runner's message, exit 2."""
    code, out, _ = run("check", EXAMPLES, *QUICK, "--modes", "nosuchmode")
    assert code == 2
    assert rows(out)[("activations.relu_", "nosuchmode", "cpu")] == ["ERROR", "-", "-"]
    assert "unknown mode 'nosuchmode'" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_skipped_with_its_reason():
    """--devices cpu,cuda without CUDA: cuda rows are skipped, the run still passes."""
    code, out, _ = run("check", EXAMPLES, "--devices", "cpu,cuda", *QUICK)
    assert code == 0
    table = rows(out)
    assert table[("activations.relu_", "eager", "cuda")] == ["skipped", "-", "-"]
    n = len(table) // 2
    assert out.rstrip().endswith(f"{n} pass, {n} skipped")


def test_json_and_html_reports_are_written(tmp_path):
    """--json writes the versioned document; --html a self-contained page."""
    j, h = tmp_path / "r.json", tmp_path / "r.html"
    code, _, _ = run("check", FAILING, *QUICK, "--json", str(j), "--html", str(h))
    assert code == 1
    doc = json.loads(j.read_text())
    assert doc["schema"] == "equiv.results/1" and doc["tool"] == "equiv check"
    assert doc["seed"] == 7 and doc["summary"]["fail"] == len(doc["results"]) >= 1
    row = next(r for r in doc["results"] if r["spec"] == "buggy_kernels.scale_stale")
    assert row["verdict"] == "fail" and (row["mode"], row["device"]) == ("eager", "cpu")
    assert {"mutation", "gradients"} <= {f["check"] for f in row["findings"]}
    html = h.read_text()
    assert '<table id="summary"' in html and "buggy_kernels.scale_stale" in html


def test_output_is_deterministic_and_plain_when_not_a_terminal():
    """Same seed, same output; no escape codes or progress bar when stdout is not a TTY."""
    first = run("check", EXAMPLES, *QUICK)
    second = run("check", EXAMPLES, *QUICK)
    assert first == second
    assert "\x1b" not in first[1] + first[2]
    assert first[2] == ""


def test_list_prints_each_spec_and_its_contract():
    """equiv list names each spec, its reference and what it mutates."""
    code, out, _ = run("list", EXAMPLES)
    assert code == 0
    assert "activations.relu_\n  reference: activations.relu_ref\n  signature: relu_(x)\n" \
           "  mutates:   {'x': 'out'}\n" in out


def test_python_dash_m_equiv_runs_the_command():
    """python -m equiv check examples/failing/ exits 1 in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "equiv", "check", FAILING, *QUICK],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "MutationMismatch" in proc.stdout


def test_a_compile_mode_that_compiled_nothing_is_not_a_pass(monkeypatch, tmp_path):
    """A compile mode whose run record says 'not compiled' shows so in the table, in the JSON
    (with its compile counts) and exits 1; one that compiled passes."""
    import dataclasses

    import equiv.run
    from equiv.report import Report

    @dataclasses.dataclass(frozen=True)
    class Run:  # the shape of equiv.report.ModeResult (modes issue)
        mode: str
        device: str
        status: str
        reason: str = ""
        compilations: int | None = None
        graph_breaks: int | None = None
        break_reasons: tuple = ()

    @dataclasses.dataclass(frozen=True)
    class RunsReport(Report):
        runs: tuple = ()

    def fake_check(spec, *, modes, devices, **kw):
        (mode,), (device,) = modes, devices
        if spec.name.endswith("leaky_relu_"):
            run = Run(mode, device, "not compiled", reason="fell back to eager: graph break on "
                      "leaky_relu_", compilations=0, graph_breaks=1, break_reasons=("b",))
        else:
            run = Run(mode, device, "passed", compilations=2, graph_breaks=0)
        return RunsReport(spec=spec.name, implementation=spec.implementation,
                          reference=spec.reference, modes=modes, devices=devices,
                          examples_run=4, runs=(run,))

    monkeypatch.setattr(equiv.run, "check", fake_check)
    path = tmp_path / "r.json"
    code, out, _ = run("check", EXAMPLES, *QUICK, "--modes", "compile[aot_eager]",
                       "--json", str(path))
    assert code == 1
    table = rows(out)
    assert table[("activations.relu_", "compile[aot_eager]", "cpu")][0] == "pass"
    assert table[("activations.leaky_relu_", "compile[aot_eager]", "cpu")][0] == "not compiled"
    assert "fell back to eager: graph break on leaky_relu_" in out
    results = {r["spec"]: r for r in json.loads(path.read_text())["results"]}
    assert results["activations.leaky_relu_"]["verdict"] == "not-compiled"
    assert results["activations.leaky_relu_"]["compile_counts"] == {
        "compilations": 0, "graph_breaks": 1, "break_reasons": ["b"], "recompile_reasons": []}
    assert results["activations.relu_"]["compile_counts"]["compilations"] == 2


def test_devices_named_by_the_decorator_are_used(tmp_path):
    """A spec's decorator settings choose its devices over the command line's."""
    f = tmp_path / "everywhere.py"
    f.write_text(textwrap.dedent('''
        import torch
        import equiv
        from equiv import equivalent_to

        def neg_ref(x):
            return -x

        @equivalent_to(neg_ref, settings=equiv.settings(devices=("cpu", "cuda")))
        def neg(x):
            return torch.neg(x)
    '''))
    code, out, _ = run("check", str(f), "--devices", "cpu", *QUICK)
    assert code == 0
    listed = run("list", str(f))[1]
    assert "  settings:  devices=('cpu', 'cuda') (from the decorator; wins over options)" in listed
    rows = [ln.split()[:4] for ln in out.splitlines() if ln.startswith("everywhere.neg")]
    cuda = "pass" if torch.cuda.is_available() else "skipped"
    assert rows == [["everywhere.neg", "eager", "cpu", "pass"],
                    ["everywhere.neg", "eager", "cuda", cuda]]
