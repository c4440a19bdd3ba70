"""Detection of the derived-input (independent lengths and extremes too), cotangent,
batched-gradient and write-only bugs
(tests/test_derived_inputs.py) at the default budget of 60 examples over N seeds, and time per
example on the shipped examples: with the hard cases on and off, and (``--before DIR``, a
checkout of an earlier commit) this tree against that one, interleaved in one run.

    python bench/detection_inputs.py [--seeds 20] [--rounds 3] [--before DIR]

``DIR`` from ``git archive <commit> | tar -x -C DIR``, plus a link ``DIR/equiv/strategies ->
DIR/strategies`` (the package maps ``equiv.strategies`` to ``strategies/``; without the link an
editable install would import this tree's strategies into the earlier equiv).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

import hypothesis

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import equiv  # noqa: E402
import equiv.strategies as es  # noqa: E402
import equiv.variants as variants  # noqa: E402


def bugs() -> dict:
    """name -> (implementation, modes)."""
    import test_derived_inputs as t
    from equiv import equivalent_to

    eager, out = ("eager",), {}
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
    out["backward reads grad as row-major"] = t._double(
        lambda g: g.as_strided((g.numel(),), (1,), g.storage_offset()).reshape(g.shape) * 2)
    out["backward grad.view(-1)"] = t._double(lambda g: g.view(-1).view(g.shape) * 2)
    out["backward on an undefined grad"] = t._both(lambda g1, g2: g1 * 2 + g2 * 3)
    out["out= kernel reads its buffer"] = t._add_out(t._reads_out, write_only=("out",))
    out["causal mask at the wrong corner"] = equivalent_to(t.attention_ref)(
        lambda q, k, v: t._attention(q, k, v, bottom_right=False))
    out["clip without non-finite check"] = equivalent_to(t.clip_ref, variants=t.EXTREMES)(
        t._clip_unguarded)
    out["naive float16 softplus"] = equivalent_to(
        t.torch.nn.functional.softplus, variants=t.EXTREMES, settings=t.HALF)(
        lambda x: t._naive_softplus(x))
    out = {k: (v, eager) for k, v in out.items()}

    def unbatched(ctx, grad):
        buf = t.torch.zeros(ctx.shape, dtype=grad.dtype)
        return buf.copy_(grad * 2)
    out["batched grad, unbatched buffer"] = (t._double_batched(unbatched), ("vmap",))
    return out


def detection(seeds: int) -> None:
    print(f"{'bug':34} caught within 60 examples")
    for name, (impl, modes) in bugs().items():
        hits = 0
        for seed in range(seeds):
            cfg = equiv.settings(seed=seed, max_examples=60, modes=modes,
                                 hypothesis_settings=hypothesis.settings(database=None))
            r = equiv.check(impl, settings=cfg, raise_on_failure=False)
            hits += not r.ok
        print(f"{name:34} {hits:>2}/{seeds}", flush=True)


def timing(rounds: int) -> None:
    """Before (hard cases and the row-column variant off) and after, interleaved."""
    from equiv._loader import load_target

    specs = load_target(str(ROOT / "examples"))
    plain, row_column = es.arguments_for, variants._ROW_COLUMN_MAX

    def off(*a, **k):
        k["hard_cases"] = False
        return plain(*a, **k)

    totals = {"before": [0.0, 0], "after": [0.0, 0]}
    for _ in range(rounds):
        for label in ("before", "after"):
            es.arguments_for = off if label == "before" else plain
            variants._ROW_COLUMN_MAX = 0 if label == "before" else row_column
            for s in specs:
                cfg = equiv.settings(max_examples=60, modes=("eager",), seed=0,
                                     hypothesis_settings=hypothesis.settings(database=None))
                t0 = time.perf_counter()
                r = equiv.check(s, settings=cfg, raise_on_failure=False)
                totals[label][0] += time.perf_counter() - t0
                totals[label][1] += r.examples_run
    es.arguments_for, variants._ROW_COLUMN_MAX = plain, row_column
    per = {k: 1e3 * v[0] / max(v[1], 1) for k, v in totals.items()}
    print(f"time per example on examples/ (eager, {rounds} interleaved rounds): before "
          f"{per['before']:.2f} ms, after {per['after']:.2f} ms, "
          f"ratio {per['after'] / per['before']:.2f}")


_ONE_ROUND = """
import sys, time, hypothesis, equiv, equiv.strategies
from equiv._loader import load_target
t, n = 0.0, 0
for s in load_target(sys.argv[1]):
    cfg = equiv.settings(max_examples=60, modes=("eager",), seed=0,
                         hypothesis_settings=hypothesis.settings(database=None))
    t0 = time.perf_counter()
    r = equiv.check(s, settings=cfg, raise_on_failure=False)
    t += time.perf_counter() - t0
    n += r.examples_run
print(equiv.__file__, equiv.strategies.__file__, t, n)
"""


def versions(rounds: int, before: str) -> None:
    """Time per example on examples/ (eager, default checks): the tree at ``before`` against
    this one, each round in a fresh interpreter, alternating."""
    totals = {"before": [0.0, 0], "after": [0.0, 0]}
    for _ in range(rounds):
        for label, src in (("before", before), ("after", str(ROOT))):
            env = dict(os.environ, PYTHONPATH=src)
            out = subprocess.run([sys.executable, "-c", _ONE_ROUND, str(ROOT / "examples")],
                                 env=env, cwd=src, capture_output=True, text=True, check=True)
            where, strategies, t, n = out.stdout.split()[-4:]
            assert where.startswith(src) and strategies.startswith(src), (where, strategies, src)
            totals[label][0] += float(t)
            totals[label][1] += int(n)
    per = {k: 1e3 * v[0] / max(v[1], 1) for k, v in totals.items()}
    print(f"time per example on examples/ (eager, {rounds} interleaved rounds): before "
          f"{per['before']:.2f} ms ({totals['before'][1]} examples), after "
          f"{per['after']:.2f} ms ({totals['after'][1]} examples), "
          f"ratio {per['after'] / per['before']:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default=None, help="a checkout of an earlier commit")
    p.add_argument("--skip-detection", action="store_true")
    a = p.parse_args()
    if not a.skip_detection:
        detection(a.seeds)
    if a.before:
        versions(a.rounds, a.before)
    else:
        timing(a.rounds)
