"""The benchmark scripts run (tiny sizes) so they cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke(tmp_path):
    out = tmp_path / "results.md"
    proc = subprocess.run([sys.executable, "bench/run.py", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    for title in ("## Overhead", "## Growth", "## Versus gradcheck", "## Time to first failure",
                  "## Compilations"):
        assert title in text
    assert "| wrong backward formula | caught" in text
