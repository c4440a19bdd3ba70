"""Numerics (docs/numerics.md): false alarms of the baseline-relative verdict on correct
implementations, detection of float16/bfloat16 bugs, and how many extra reference calls the
oracle costs per example.

    python bench/numerics_bench.py [--seeds 3] [--examples 100] [--bug-seeds 20]
                                   [--bug-examples 60] [--smoke]

False alarms: every shipped example (examples/*.py, eager mode) and the correct twins of
tests/test_numerics.py, ``--seeds`` seeds x ``--examples`` examples each; a report with any
finding is a false alarm. Detection: the float16/bfloat16 bugs at the default profile with
``--bug-examples`` examples, on ``--bug-seeds`` seeds; found means a finding in that budget.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import hypothesis
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import equiv  # noqa: E402
from equiv import equivalent_to  # noqa: E402
from equiv._loader import load_target  # noqa: E402
from equiv.strategies import tensors  # noqa: E402


def _twins_and_bugs() -> tuple[list, list]:
    import test_numerics as tn

    fp16_bug, fp16_ok = tn._fp16_specs()
    split_ok, _ = tn._split_k_specs()
    sin_ok, _ = tn._numpy_sin_specs()

    def silu_ref(x):
        return F.silu(x)

    bf16 = st.tuples(tensors(shape=(64,), dtype=torch.bfloat16, requires_grad=True, scale=4.0))

    @equivalent_to(silu_ref, inputs=bf16)
    def silu_formula(x):
        return x * torch.sigmoid(x)

    @equivalent_to(silu_ref, inputs=bf16)
    def silu_gelu_constant(x):  # a bfloat16 bug: GELU's sigmoid approximation constant
        return x * torch.sigmoid(1.702 * x)

    def mm_ref(a, b):
        return a @ b

    @equivalent_to(mm_ref, inputs=tn._matmul_inputs(torch.bfloat16))
    def mm_bf16_acc(a, b):  # a bfloat16 bug: accumulating the products in bfloat16
        return tn._matmul_acc(a, b, torch.bfloat16)

    def double_ref(x):
        return x * 2

    @equivalent_to(double_ref)  # derived inputs: float16/bfloat16 examples by default
    def double_half(x):  # a float16 bug: a mis-rounded constant (0.2% off)
        return x * 2.004 if x.dtype == torch.float16 else x * 2

    @equivalent_to(double_ref)
    def double_upcast(x):  # its correct twin: computes half inputs in float32
        return (x.float() * 2).to(x.dtype) if x.dtype in (torch.float16, torch.bfloat16) \
            else x * 2

    twins = [fp16_ok, split_ok, sin_ok, silu_formula, double_upcast]
    bugs = [fp16_bug, mm_bf16_acc, silu_gelu_constant, double_half]
    return twins, bugs


def _settings(seed: int, examples: int) -> equiv.settings:
    return equiv.settings(seed=seed, max_examples=examples, modes=("eager",),
                          hypothesis_settings=hypothesis.settings(database=None))


def false_alarms(seeds: int, examples: int) -> list[tuple[str, int, int, str]]:
    """(spec, runs, runs with a finding, the checks that fired) per correct spec."""
    twins, _ = _twins_and_bugs()
    specs = list(load_target(str(ROOT / "examples"))) + twins
    rows = []
    for spec in specs:
        bad, fired = 0, set()
        for seed in range(seeds):
            report = equiv.check(spec, settings=_settings(seed, examples),
                                 raise_on_failure=False)
            bad += not report.ok
            fired |= {f.check for f in report.findings}
        name = getattr(spec, "name", None) or spec.__equiv_spec__.name
        rows.append((name.split(".")[-1], seeds, bad, ", ".join(sorted(fired)) or "-"))
    return rows


def detection(seeds: int, examples: int) -> list[tuple[str, int, int, float]]:
    """(bug, seeds, seeds on which it was found, mean examples to the first failure)."""
    _, bugs = _twins_and_bugs()
    rows = []
    for bug in bugs:
        found, firsts = 0, []
        for seed in range(seeds):
            report = equiv.check(bug, settings=equiv.settings(
                seed=seed, max_examples=examples,
                hypothesis_settings=hypothesis.settings(database=None)), raise_on_failure=False)
            if not report.ok:
                found += 1
                firsts.append(report.first_failure_at or 0)
        rows.append((bug.__equiv_spec__.name.split(".")[-1], seeds, found,
                     sum(firsts) / len(firsts) if firsts else float("nan")))
    return rows


def reference_calls(examples: int) -> tuple[float, float, float]:
    """Reference calls per example (all, float64 ones) for a correct float32 spec and a
    float16 one; the oracle is the only float64 call."""
    counts = {"all": 0, "f64": 0}

    def ref(x):
        counts["all"] += 1
        counts["f64"] += x.dtype == torch.float64
        return torch.sin(x)

    inputs = st.tuples(tensors(shape=(32,), dtype=torch.float16, requires_grad=True))

    @equivalent_to(ref, inputs=inputs)
    def sin_half(x):
        return torch.sin(x.float()).to(x.dtype)

    report = equiv.check(sin_half, settings=_settings(0, examples), checks=("forward",
                         "gradients"))
    n = max(report.examples_run, 1)
    return counts["all"] / n, counts["f64"] / n, n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--bug-seeds", type=int, default=20)
    p.add_argument("--bug-examples", type=int, default=60)
    p.add_argument("--smoke", action="store_true", help="1 seed, 10 examples, 2 bug seeds")
    a = p.parse_args()
    if a.smoke:
        a.seeds, a.examples, a.bug_seeds, a.bug_examples = 1, 10, 2, 30
    t0 = time.perf_counter()
    print(f"## Numerics: false alarms ({a.seeds} seeds x {a.examples} examples, eager)\n")
    print("| correct spec | runs | runs with a finding | checks that fired |")
    print("| --- | --- | --- | --- |")
    for name, runs, bad, fired in false_alarms(a.seeds, a.examples):
        print(f"| {name} | {runs} | {bad} | {fired} |")
    print(f"\n## Numerics: detection ({a.bug_seeds} seeds, {a.bug_examples} examples, "
          "default profile)\n")
    print("| bug | seeds | found | mean examples to the first failure |")
    print("| --- | --- | --- | --- |")
    for name, seeds, found, first in detection(a.bug_seeds, a.bug_examples):
        print(f"| {name} | {seeds} | {found} | {first:.1f} |")
    calls, f64, n = reference_calls(a.examples)
    print(f"\nreference calls per example (float16 spec, forward + gradients, {n:.0f} "
          f"examples): {calls:.2f} in all, {f64:.2f} in float64 (the oracle)")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
