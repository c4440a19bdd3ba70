"""equiv against the test a user would otherwise write, and against the executed raw.

For each of the overhead bench's kernels (bench/overhead.py: relu_ in place, an RMSNorm, a
scaled custom ``torch.autograd.Function``; x of shape (n/1000, 1000), w of shape (1000,)):

- *equiv*: ``equiv.check`` with the default checks, eager;
- *peer*: the hand-written Hypothesis test a user would write instead: the same strategy and
  number of examples, impl and ref on copies, ``torch.testing.assert_close`` on the outputs and
  on the mutated argument, one random cotangent, one backward each side and ``assert_close`` on
  the gradients;
- *executed raw*: both sides' forward + two backwards on the examples equiv really executed
  (its input variants and cotangent layouts: the kernel's own cost on those examples).

Interleaved rounds (the order rotates), medians of the per-round ratios.
``--profile`` adds, per row, where check()'s time goes (cProfile, self time by area).

``--floor`` adds *equiv floor*: check() with the two extras the speed decision keeps switched
off (``backward_repeats=1``; the costly checks on the first example only), in the same
rounds: how much of equiv/peer those two decisions account for.

``--traffic`` adds, per row, the elements check() runs through copy and comparison ops (a
count, not a time: the same on a loaded machine as on a quiet one).

    python bench/peer.py [--examples 40] [--sizes 1000,1000000] [--rounds 5] [--profile]
                         [--traffic] [--floor]
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import hypothesis
import hypothesis.strategies as st
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead  # noqa: E402
from overhead import CASES, Case  # noqa: E402


def shape_of(numel: int) -> tuple[int, int]:
    """x's shape for ``numel`` elements: (numel / 1000, 1000), w is (1000,)."""
    return (max(numel // 1000, 1), 1000)


def peer_test(case: Case, strategy: st.SearchStrategy, n: int) -> Callable[[], None]:
    """The hand-written property test: ``n`` examples of ``strategy``, outputs, the mutated
    argument and one backward compared with ``assert_close``."""
    @hypothesis.settings(max_examples=n, database=None, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(strategy)
    def test(ex):
        impl_leaves = [t.detach().clone().requires_grad_() for t in ex]
        ref_leaves = [t.detach().clone().requires_grad_() for t in ex]
        first = impl_leaves[0].clone() if case.mutates else impl_leaves[0]
        out = case.call(first, *impl_leaves[1:])
        expected = case.ref(*ref_leaves)
        torch.testing.assert_close(out, expected)
        if case.mutates:
            torch.testing.assert_close(first, expected)
        cot = torch.randn_like(expected)
        got = torch.autograd.grad(out, impl_leaves, cot)
        want = torch.autograd.grad(expected, ref_leaves, cot)
        torch.testing.assert_close(got, want)

    return test


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


#: where check()'s self time goes: (area, substrings of the file path), first match wins
_AREAS = (("hypothesis engine", ("/hypothesis/",)),
          ("equiv strategies and variants", ("/strategies/", "equiv/variants.py")),
          ("equiv examples (templates, sides)", ("equiv/examples.py",)),
          ("equiv execution core", ("equiv/execution/",)),
          ("equiv checks", ("equiv/checks/",)),
          ("equiv run loop", ("equiv/run.py", "equiv/pipeline.py", "equiv/_settings.py",
                              "equiv/modes.py", "equiv/spec.py")),
          ("equiv other", ("/equiv/",)),
          ("torch python", ("/torch/",)),
          ("builtins (torch ops, C)", ("~", "<built-in")))


def profile(fn, n: int) -> str:
    """check()'s self time by area and its top functions, one profiled run."""
    prof = cProfile.Profile()
    prof.enable()
    overhead.check_time(fn, n)
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())
    areas: collections.Counter = collections.Counter()
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
        area = next((a for a, keys in _AREAS if any(k in file for k in keys)), "other")
        areas[area] += own
        rows.append((own, calls, f"{Path(file).name}:{line}({name})"))
    text = [f"profiled check(): {total:.3f} s self time in all",
            "| area | share of self time |", "| --- | ---: |"]
    text += [f"| {a} | {100 * t / total:.0f}% |" for a, t in areas.most_common()]
    text += ["", "| function | self s | calls |", "| --- | ---: | ---: |"]
    text += [f"| `{f}` | {own:.3f} | {calls} |" for own, calls, f in sorted(rows)[::-1][:12]]
    return "\n".join(text)


#: the ATen copy and comparison ops :func:`traffic` counts
_TRAFFIC_OPS = ("clone", "copy_", "_to_copy", "flip", "equal", "eq", "ne", "isnan", "any", "all",
                "bitwise_and", "bitwise_or", "bitwise_not")


def traffic(fn, n: int) -> str:
    """The elements one check() runs through copy and comparison ops (first tensor argument
    of each call), by op: ``clone 204 calls 257.0M``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: collections.Counter = collections.Counter()
    elements: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            t = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if name in _TRAFFIC_OPS and t is not None:
                calls[name] += 1
                elements[name] += t.numel()
            return func(*args, **(kwargs or {}))

    with Count():
        overhead.check_time(fn, n)
    parts = [f"{k} {calls[k]} calls {elements[k] / 1e6:.1f}M" for k in sorted(elements)]
    return f"all {sum(elements.values()) / 1e6:.1f}M elements: " + ", ".join(parts)


#: check()'s settings without the decided extras: no second backward, the costly checks on
#: the first valid example only (a share below one in any example count)
FLOOR = {"backward_repeats": 1, "costly_share": 1e-9}


def measure(case: Case, numel: int, n: int, rounds: int, floor: bool = False) -> dict:
    """Interleaved rounds of check(), the peer test and the executed raw on ``case``."""
    strategy = overhead._inputs(case.arity, shape_of(numel))
    fn = overhead.equivalent_to(case.ref, mutates=case.mutates, inputs=strategy,
                                name=f"bench.peer.{next(overhead._NAMES)}")(case.impl)
    _, ran = overhead.check_time(fn, n)  # warm-up, and how many examples check() runs
    executed = overhead.executed_examples(fn, n)
    peer = peer_test(case, strategy, n)
    peer()  # warm-up
    overhead.raw_executed_time(case, executed[:1])
    runs = {"equiv": lambda: overhead.check_time(fn, n),
            "peer": peer,
            "raw": lambda: overhead.raw_executed_time(case, executed)}
    if floor:
        runs["floor"] = lambda: overhead.check_time(fn, n, **FLOOR)
        runs["floor"]()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            times[k].append(_timed(runs[k]))
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))
    return {"examples": ran, "executed": len(executed),
            **{k: statistics.median(v) for k, v in times.items()},
            "equiv/peer": ratio("equiv", "peer"), "equiv/raw": ratio("equiv", "raw"),
            "peer/raw": ratio("peer", "raw"), "fn": fn,
            **({"floor/peer": ratio("floor", "peer")} if floor else {})}


def bench(examples: int = 40, sizes: tuple[int, ...] = (1000, 1_000_000), rounds: int = 5,
          profiled: bool = False, counted: bool = False, floor: bool = False) -> str:
    """The peer table (markdown) for every case at every size."""
    rows = [f"{rounds} interleaved rounds per row (order rotating), eager, default checks; x "
            "(n/1000, 1000), w (1000,); peer = the hand-written Hypothesis test (same strategy "
            "and max_examples, assert_close on outputs, the mutated argument and one backward); "
            "raw = both sides' forward + 2 backwards on the examples check() executed; ratios "
            "are medians of per-round ratios", "",
            "| case | elements | examples (executed) | equiv s | peer s | raw s | equiv/peer "
            "| equiv/raw | peer/raw |" + (" equiv floor/peer |" if floor else ""),
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
            + (" ---: |" if floor else "")]
    profiles = []
    for numel in sizes:
        n = examples if numel < 100_000 else max(examples // 4, 3)
        for case in CASES:
            m = measure(case, numel, n, rounds, floor)
            rows.append(f"| {case.label} | {numel:,} | {m['examples']} ({m['executed']}) | "
                        f"{m['equiv']:.3f} | {m['peer']:.3f} | {m['raw']:.3f} | "
                        f"{m['equiv/peer']:.1f}x | {m['equiv/raw']:.1f}x | "
                        f"{m['peer/raw']:.1f}x |"
                        + (f" {m['floor/peer']:.1f}x |" if floor else ""))
            if counted:
                profiles.append(f"copy and comparison traffic, {case.label}, {numel:,} "
                                f"elements: {traffic(m['fn'], n)}\n")
            if profiled:
                profiles.append(f"### {case.label}, {numel:,} elements\n\n"
                                + profile(m["fn"], n))
    table = "\n".join(rows + [""] + profiles)
    print(table)
    return table


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--examples", type=int, default=40)
    p.add_argument("--sizes", default="1000,1000000")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="where check()'s time goes, per row")
    p.add_argument("--traffic", action="store_true",
                   help="elements through copy and comparison ops, per row")
    p.add_argument("--floor", action="store_true",
                   help="also check() without a second backward, costly checks on one example")
    args = p.parse_args(argv)
    return bench(args.examples, tuple(int(s) for s in args.sizes.split(",")), args.rounds,
                 args.profile, args.traffic, args.floor)


if __name__ == "__main__":
    main()
