"""Wall time a user waits for: `equiv check examples/` and the test suite, each a fresh
subprocess (interpreter start and imports included), median of N runs.

    python bench/walltime.py [--runs 3] [--suite] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the default-profile command line of the CLI on the shipped examples
CHECK = ("-m", "equiv", "check", "examples/")
#: the quick stand-in: one small example file, eager, 2 examples
CHECK_QUICK = ("-m", "equiv", "check", "examples/x_squared_lab.py", "--modes", "eager",
               "--max-examples", "2")
#: the test suite as contributors run it (the slow suite excluded)
SUITE = ("-m", "pytest", "-q", "-n", "2", "-m", "not slow", "-p", "no:randomly", "tests/")
#: the quick stand-in: one small test file
SUITE_QUICK = ("-m", "pytest", "-q", "-m", "not slow", "-p", "no:randomly",
               "tests/test_printing.py")


def timed(args: tuple[str, ...], runs: int) -> tuple[float, float, int]:
    """(median s, min s, last exit status) of ``python *args`` run ``runs`` times from the root."""
    env = {k: v for k, v in os.environ.items() if k not in ("EQUIV_PROFILE", "CI")}
    times, rc = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        times.append(time.perf_counter() - start)
        rc = proc.returncode
        if rc not in (0, 1):  # 1 is a finding (a fact to report); anything else is a crash
            raise RuntimeError(f"python {shlex.join(args)} exited {rc}:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return statistics.median(times), min(times), rc


def bench(runs: int = 3, suite: bool = False, quick: bool = False) -> str:
    """The wall-time table (markdown); the suite row only with ``suite=True``."""
    rows = [f"each a fresh `python` subprocess from the repository root, median of {runs}", "",
            "| command | runs | median s | min s | exit status |", "| --- | ---: | ---: | ---: | ---: |"]
    cases = [CHECK_QUICK if quick else CHECK]
    if suite:
        cases.append(SUITE_QUICK if quick else SUITE)
    for args in cases:
        median, best, rc = timed(args, runs)
        rows.append(f"| `python {shlex.join(args)}` | {runs} | {median:.1f} | {best:.1f} | {rc} |")
    if not suite:
        rows += ["", "(test suite not timed: pass `--suite`)"]
    table = "\n".join(rows)
    print(table)
    return table


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--suite", action="store_true", help="also time the test suite (minutes)")
    p.add_argument("--quick", action="store_true", help="one small example file / test file")
    args = p.parse_args(argv)
    return bench(args.runs, args.suite, args.quick)


if __name__ == "__main__":
    main()
