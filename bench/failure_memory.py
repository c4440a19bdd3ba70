"""Memory and time on the failure path: a failing run (found, shrunk, replayed, attributed)
against a passing run of the same kernel, each in a fresh subprocess, peak RSS from
``resource.getrusage`` (each child's own ``ru_maxrss``) and the seconds ``check()`` took.

    python bench/failure_memory.py [--sizes 1e7,5e7] [--examples 5]

The kernel is an elementwise ``x * 2 + 1`` on one float32 vector of N elements; the wrong twin
is off by 1e-3 everywhere, so every example fails.

``--against-raw`` measures the passing path instead: for each of the overhead bench's kernels
(``--cases``, default 0: relu_ in place; bench/overhead.py), a passing check() against the raw
run (impl and ref forward + 2 backwards on one drawn example), each in a fresh subprocess:
peak RSS, and the peak above the interpreter's RSS after imports.

    python bench/failure_memory.py --against-raw [--sizes 1e7] [--examples 5] [--cases 0]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

_CHILD = r"""
import json, resource, sys, time
import hypothesis, torch
import equiv
from equiv import equivalent_to
from equiv.strategies import tensors
import hypothesis.strategies as st

n, examples, wrong = int(float(sys.argv[1])), int(sys.argv[2]), sys.argv[3] == "1"

def ref(x):
    return x * 2 + 1

@equivalent_to(ref, inputs=st.tuples(tensors(shape=(n,), dtype=torch.float32)),
               name="failure_memory.kernel")
def kernel(x):
    return x * 2 + (1.001 if wrong else 1)

start = time.perf_counter()
report = equiv.check(kernel, modes=("eager",), seed=0, max_examples=examples,
                     settings=equiv.settings(hypothesis_settings=hypothesis.settings(
                         database=None)), raise_on_failure=False)
print(json.dumps({"seconds": time.perf_counter() - start, "ok": report.ok,
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "findings": len(report.findings), "examples": report.examples_run}))
"""


_RAW_CHILD = r"""
import json, os, resource, sys
sys.path.insert(0, sys.argv[4])
import overhead, peer
page = os.sysconf("SC_PAGE_SIZE")
case, n, examples = overhead.CASES[int(sys.argv[1])], int(float(sys.argv[2])), int(sys.argv[3])
strategy = overhead._inputs(case.arity, peer.shape_of(n))
fn = overhead.equivalent_to(case.ref, mutates=case.mutates, inputs=strategy,
                            name="failure_memory.raw")(case.impl)
drawn = overhead.draw_examples(strategy, 1)
overhead.raw_time(case, [tuple(t[:1] if i == 0 else t for i, t in enumerate(drawn[0]))])  # warm-up
with open("/proc/self/statm") as f:
    base = int(f.read().split()[1]) * page
if sys.argv[5] == "raw":
    overhead.raw_time(case, drawn)
else:
    overhead.check_time(fn, examples)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_mib": peak / 2**20, "above_mib": (peak - base) / 2**20}))
"""


def against_raw(sizes: tuple[float, ...] = (1e7,), examples: int = 5,
                cases: tuple[int, ...] = (0,), timeout: float = 1200) -> str:
    """The passing path's table (markdown): check()'s peak RSS against the raw run's."""
    here = str(Path(__file__).resolve().parent)
    rows = ["| case | elements | raw: peak RSS (above imports) | check(): peak RSS (above "
            "imports) | ratio | ratio above imports |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for n in sizes:
        for c in cases:
            got = {}
            for what in ("raw", "check"):
                proc = subprocess.run([sys.executable, "-c", _RAW_CHILD, str(c), repr(n),
                                       str(examples), here, what], capture_output=True,
                                      text=True, timeout=timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"the child failed: {proc.stderr[-2000:]}")
                got[what] = json.loads(proc.stdout.strip().splitlines()[-1])
            raw, chk = got["raw"], got["check"]
            label = _case_label(c)
            rows.append(f"| {label} | {n:.0e} | {raw['peak_mib']:.0f} ({raw['above_mib']:.0f}) "
                        f"MiB | {chk['peak_mib']:.0f} ({chk['above_mib']:.0f}) MiB | "
                        f"{chk['peak_mib'] / raw['peak_mib']:.1f}x | "
                        f"{chk['above_mib'] / max(raw['above_mib'], 1):.1f}x |")
    table = "\n".join(rows)
    print(table)
    return table


def _case_label(c: int) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import overhead
    return overhead.CASES[c].label


def _child(n: float, examples: int, wrong: bool, timeout: float) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, repr(n), str(examples),
                           "1" if wrong else "0"], capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(peak_mib=out["peak_kib"] / 1024, wall=wall)  # the child's own peak RSS
    return out


def bench(sizes: tuple[float, ...] = (1e7, 5e7), examples: int = 5,
          timeout: float = 1200) -> str:
    """The table (markdown): per size, the passing and the failing run's peak RSS and time."""
    rows = ["| elements | passing: peak RSS | passing: seconds | failing: peak RSS | "
            "failing: seconds | RSS ratio | time ratio |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in sizes:
        runs = {}
        for wrong in (False, True):  # a fresh process each
            runs[wrong] = _child(n, examples, wrong, timeout)
        ok, bad = runs[False], runs[True]
        assert ok["ok"] and not bad["ok"], (ok, bad)
        ok_peak, bad_peak = ok["peak_mib"], bad["peak_mib"]
        rows.append(f"| {n:.0e} | {ok_peak:.0f} MiB | {ok['seconds']:.1f} | "
                    f"{bad_peak:.0f} MiB | {bad['seconds']:.1f} | "
                    f"{bad_peak / ok_peak:.2f} | {bad['seconds'] / ok['seconds']:.2f} |")
    table = "\n".join(rows)
    print(table)
    return table


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="1e7,5e7", help="comma-separated element counts")
    p.add_argument("--examples", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per child run")
    p.add_argument("--against-raw", action="store_true",
                   help="the passing path: check()'s peak RSS against the raw run's")
    p.add_argument("--cases", default="0", help="with --against-raw: overhead bench cases")
    a = p.parse_args(argv)
    if a.against_raw:
        sizes = tuple(float(s) for s in a.sizes.split(",")) if a.sizes != "1e7,5e7" else (1e7,)
        return against_raw(sizes, a.examples, tuple(int(c) for c in a.cases.split(",")),
                           a.timeout)
    return bench(tuple(float(s) for s in a.sizes.split(",")), a.examples, a.timeout)


if __name__ == "__main__":
    main()
