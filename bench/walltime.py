"""Wall time a user waits for: `equiv check examples/` and the test suite, each a fresh
subprocess (interpreter start and imports included), median of N runs.

    python bench/walltime.py [--runs 3] [--suite] [--quick]
    python bench/walltime.py --workers 2 [--runs 3] [--quick]

``--workers N``: `equiv check -n 0` against `-n N` on the examples (fixed seed, ci profile),
interleaved, the speedup per round and whether the JSON reports agree less their times.
"""

from __future__ import annotations

import argparse
import json
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


def _timeless(report: object) -> object:
    """A JSON report less what differs between two runs of the same seed: times."""
    if isinstance(report, dict):
        return {k: _timeless(v) for k, v in report.items()
                if not any(t in k for t in ("time", "second", "duration", "started", "elapsed"))}
    if isinstance(report, list):
        return [_timeless(v) for v in report]
    return report


def workers(n: int = 2, runs: int = 3, quick: bool = False, out: Path | None = None) -> str:
    """`equiv check -n 0` against `-n n` on the examples, interleaved (markdown)."""
    out = out or Path(os.environ.get("TMPDIR", "/tmp"))
    target = CHECK_QUICK[3:] if quick else ("examples/",)
    rows = [f"`equiv check --profile ci --seed 1 -n 0` against `-n {n}`, interleaved rounds",
            "", f"| round | -n 0 s | -n {n} s | speedup | reports agree (less times) |",
            "| ---: | ---: | ---: | ---: | --- |"]
    speedups = []
    for r in range(runs):
        got = {}
        for w in (0, n):
            path = out / f"equiv-workers-{w}.json"
            args = ("-m", "equiv", "check", *target, "--profile", "ci", "--seed", "1", "-n", str(w),
                    "--json", str(path))
            got[w] = (timed(args, 1)[0], json.loads(path.read_text()))
        speedups.append(got[0][0] / got[n][0])
        same = _timeless(got[0][1]) == _timeless(got[n][1])
        rows.append(f"| {r + 1} | {got[0][0]:.1f} | {got[n][0]:.1f} | {speedups[-1]:.2f}x | "
                    f"{'yes' if same else 'NO'} |")
    rows += ["", f"median speedup {statistics.median(speedups):.2f}x"]
    table = "\n".join(rows)
    print(table)
    return table


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--suite", action="store_true", help="also time the test suite (minutes)")
    p.add_argument("--quick", action="store_true", help="one small example file / test file")
    p.add_argument("--workers", type=int, default=0,
                   help="time `equiv check -n 0` against `-n N` instead")
    args = p.parse_args(argv)
    if args.workers:
        return workers(args.workers, args.runs, args.quick)
    return bench(args.runs, args.suite, args.quick)


if __name__ == "__main__":
    main()
