"""Where check()'s time goes: milliseconds per example spent in each catalog check, for the
overhead bench's cases (bench/overhead.py), against raw (impl and ref forward + 2 backwards).

    python bench/rows.py [--case 0|1|2] [--numel 1000000] [--examples 10]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import equiv.pipeline as pipeline  # noqa: E402
import overhead  # noqa: E402


class _Timed:
    """A catalog module whose ``run`` adds its wall time to a counter."""

    def __init__(self, name: str, module, spent: collections.Counter, runs: collections.Counter):
        self.name, self.module, self.spent, self.runs = name, module, spent, runs

    def run(self, ex, sink) -> None:
        start = time.perf_counter()
        try:
            self.module.run(ex, sink)
        finally:
            self.spent[self.name] += time.perf_counter() - start
            self.runs[self.name] += 1


def bench(case: int = 0, numel: int = 1_000_000, examples: int = 10) -> str:
    c = overhead.CASES[case]
    strategy = overhead._inputs(c.arity, overhead._shape(numel))
    fn = overhead.equivalent_to(c.ref, mutates=c.mutates, inputs=strategy,
                                name="bench.rows")(c.impl)
    overhead.check_time(fn, examples)  # warm-up
    drawn = overhead.draw_examples(strategy, examples)
    overhead.raw_time(c, drawn[:1])
    raw = overhead.raw_time(c, drawn)
    spent: collections.Counter = collections.Counter()
    runs: collections.Counter = collections.Counter()
    plain = dict(pipeline._MODULES)
    pipeline._MODULES.update({k: _Timed(k, m, spent, runs) for k, m in plain.items()})
    try:
        total, ran = overhead.check_time(fn, examples)
    finally:
        pipeline._MODULES.update(plain)
    lines = [f"{c.label}, {numel:,} elements: {ran} examples, check() {1e3 * total / ran:.1f} "
             f"ms per example, raw {1e3 * raw / len(drawn):.1f} ms per example", "",
             "| check | ms per example | examples it ran on |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {1e3 * v / ran:.2f} | {runs[k]} |" for k, v in spent.most_common()]
    table = "\n".join(lines)
    print(table)
    return table


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--case", type=int, default=0)
    p.add_argument("--numel", type=int, default=1_000_000)
    p.add_argument("--examples", type=int, default=10)
    a = p.parse_args(argv)
    return bench(a.case, a.numel, a.examples)


if __name__ == "__main__":
    main()
