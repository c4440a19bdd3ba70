"""Compilations per (spec, backend) over N examples of the shipped examples (goal: <= 3).

    python bench/compile_counts.py [--examples 100] [--inductor] [--seed 0] [TARGET ...]

Counts are the implementation's backend calls (``run.compilations``). Specs whose decorator pins
eager (a known compile-only divergence on torch 2.13) are listed as pinned.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("compile[eager]", "compile[aot_eager]")


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("targets", nargs="*", default=[str(ROOT / "examples")])
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inductor", action="store_true", help="add compile[inductor] (slow on CPU)")
    args = p.parse_args(argv)
    return bench(args.targets, args.examples, args.seed, args.inductor)


def bench(targets: list[str] | None = None, examples: int = 100, seed: int = 0,
          inductor: bool = False) -> str:
    """The compilations table: (spec, backend) -> compilations over ``examples`` examples."""
    import hypothesis
    import torch

    import equiv
    from equiv._loader import load_target

    backends = BACKENDS + (("compile[inductor]",) if inductor else ())
    cfg = equiv.settings(max_examples=examples, seed=seed,
                         hypothesis_settings=hypothesis.settings(database=None))
    specs = [s for t in (targets or [str(ROOT / "examples")]) for s in load_target(t)]
    rows, pinned, worst = [], [], 0
    for spec in specs:
        for mode in backends:
            report = equiv.check(spec, settings=cfg, modes=(mode,), raise_on_failure=False)
            if mode not in report.modes:
                if spec.name not in pinned:
                    pinned.append(spec.name)
                continue
            (run,) = report.runs
            worst = max(worst, run.compilations or 0)
            rows.append(f"| {spec.name} | {mode} | {run.compilations} | {run.examples} | "
                        f"{run.status} |")
    lines = [f"torch {torch.__version__}, {examples} examples per (spec, backend), "
             f"seed {seed}", "",
             "| spec | backend | compilations | examples | status |",
             "| --- | --- | ---: | ---: | --- |", *rows, "",
             f"max compilations per (spec, backend): {worst} (goal <= 3)"]
    if pinned:
        lines.append(f"pinned to eager by their decorator: {', '.join(pinned)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
    sys.exit(0)
