"""Detection of the derived-input bugs (tests/test_derived_inputs.py) at the default budget of
60 examples over N seeds, and time per example on the shipped examples with the hard cases on
and off (interleaved in one run).

    python bench/detection_inputs.py [--seeds 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import hypothesis

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import equiv  # noqa: E402
import equiv.strategies as es  # noqa: E402
import equiv.variants as variants  # noqa: E402


def bugs() -> dict:
    import test_derived_inputs as t
    from equiv import equivalent_to

    out = {}
    fn = t._complex_mul(conjugate=False)
    out["complex mul, no conj"] = equivalent_to(
        t.cmul_ref, settings=equiv.settings(dtypes=t.COMPLEX))(lambda x, y: fn.apply(x, y))
    out["cumprod / x (zeros)"] = equivalent_to(t.cumprod_ref)(lambda x: t.CumprodDivides.apply(x))
    out["tiled sum, block_sizes=(32,)"] = equivalent_to(t.rowsum_ref, block_sizes=(32,))(
        lambda x: t._tiled_sum(x, 32, True))
    out["tiled sum, default lengths"] = equivalent_to(t.rowsum_ref)(
        lambda x: t._tiled_sum(x, 32, True))
    dd = t._dedup_mul(lambda v: v.data_ptr())
    out["dedup by data_ptr"] = equivalent_to(t.cmul_ref)(lambda x, y: dd.apply(x, y))
    return out


def detection(seeds: int) -> None:
    print(f"{'bug':32} caught within 60 examples")
    for name, impl in bugs().items():
        hits, firsts = 0, []
        for seed in range(seeds):
            cfg = equiv.settings(seed=seed, max_examples=60, modes=("eager",),
                                 hypothesis_settings=hypothesis.settings(database=None))
            r = equiv.check(impl, settings=cfg, raise_on_failure=False)
            hits += not r.ok
        print(f"{name:32} {hits:>2}/{seeds}")


def timing(rounds: int) -> None:
    """Before (hard cases and the row-column variant off) and after, interleaved."""
    from equiv._loader import load_target

    specs = load_target(str(ROOT / "examples"))
    plain = es.arguments_for

    def off(*a, **k):
        k["hard_cases"] = False
        return plain(*a, **k)

    totals = {"before": [0.0, 0], "after": [0.0, 0]}
    for _ in range(rounds):
        for label in ("before", "after"):
            es.arguments_for = off if label == "before" else plain
            variants._ROW_COLUMN_MAX = 0 if label == "before" else 256
            for s in specs:
                cfg = equiv.settings(max_examples=60, modes=("eager",), seed=0,
                                     hypothesis_settings=hypothesis.settings(database=None))
                t0 = time.perf_counter()
                r = equiv.check(s, settings=cfg, raise_on_failure=False)
                totals[label][0] += time.perf_counter() - t0
                totals[label][1] += r.examples_run
    es.arguments_for, variants._ROW_COLUMN_MAX = plain, 256
    per = {k: 1e3 * v[0] / max(v[1], 1) for k, v in totals.items()}
    print(f"time per example on examples/ (eager, {rounds} interleaved rounds): before "
          f"{per['before']:.2f} ms, after {per['after']:.2f} ms, "
          f"ratio {per['after'] / per['before']:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    detection(a.seeds)
    timing(a.rounds)
