"""Time to first failure: for each bug class, over several seeds in the default profile, the
median number of examples until the bug is first seen and the median seconds until the shrunk
report is ready.

    python bench/first_failure.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import equiv  # noqa: E402
from equiv import equivalent_to  # noqa: E402
from versus import BUGS, _WORKSPACE  # noqa: E402


def _derived(impl, ref, label):
    # inputs derived from the signature, as a user who writes no strategy gets them
    return equivalent_to(ref, name=f"ttff.{label}")(impl)


def bench(seeds: int = 5, bugs: int | None = None) -> str:
    """The time-to-first-failure table (markdown) over ``seeds`` seeds per bug, on the first
    ``bugs`` bugs (all by default)."""
    rows = ["| bug | found (of seeds) | median examples to first failure | median seconds to report |",
            "| --- | ---: | ---: | ---: |"]
    for label, impl, ref, _ in BUGS[:bugs]:
        examples, seconds, found = [], [], 0
        fn = _derived(impl, ref, label)
        for seed in range(seeds):
            _WORKSPACE.clear()
            cfg = equiv.settings(seed=seed, hypothesis_settings=hypothesis.settings(database=None))
            start = time.perf_counter()
            report = equiv.check(fn, settings=cfg, raise_on_failure=False)
            elapsed = time.perf_counter() - start
            if not report.ok:
                found += 1
                examples.append(report.first_failure_at or 0)
                seconds.append(elapsed)
        med_e = f"{statistics.median(examples):.0f}" if examples else "-"
        med_s = f"{statistics.median(seconds):.2f}" if seconds else "-"
        rows.append(f"| {label} | {found}/{seeds} | {med_e} | {med_s} |")
    table = "\n".join(rows)
    print(table)
    return table


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, default=5)
    return bench(p.parse_args(argv).seeds)


if __name__ == "__main__":
    main()
