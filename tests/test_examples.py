"""The shipped examples: correct ones pass `equiv check examples/`, the buggy module fails with a
readable finding that names the check, the argument, the numbers and the shrunk example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "equiv", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_correct_examples_pass():
    out = run_cli("check", "examples/", "--max-examples", "10", "--seed", "7")
    assert out.returncode == 0, out.stdout + out.stderr
    assert " pass " in out.stdout and "FAIL" not in out.stdout  # the summary table's verdicts
    assert "relu_" in out.stdout


def test_buggy_example_fails_readably():
    out = run_cli("check", "examples/failing/", "--max-examples", "10", "--seed", "7")
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "FAIL" in text
    # the stale gradient is a follow-on of the write that staled it (its timeline shows it)
    assert "follow-on findings: gradients (eager)" in text and "gradient w.r.t. 'x'" in text
    assert "    how: saved 'w' (forward step 1" in text  # the timeline's story, under the root
    assert "Greatest absolute difference" in text
    assert "Minimal failing example:" in text and "scale_stale(x=f32[" in text
    assert "argument 'w' was modified" in text


def test_import_error_exits_2_with_the_traceback(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\nraise RuntimeError('boom at import')\n")
    out = run_cli("check", str(bad))
    assert out.returncode == 2
    assert "boom at import" in out.stderr and "Traceback" in out.stderr
