"""Compilations per (spec, backend) over N examples of the shipped examples and two kernels that
read a scalar with ``.item()`` (goal: <= 3), with Dynamo's reasons for each recompilation.

    python bench/compile_counts.py [--examples 100] [--inductor] [--seed 0] [--no-scalar] [TARGET ...]

Counts are the implementation's backend calls (``run.compilations``); wall time is the whole
``equiv.check`` of that (spec, backend). Specs whose decorator pins eager (a known compile-only
divergence on torch 2.13) are listed as pinned.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import equiv

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("compile[eager]", "compile[aot_eager]")


def _centred_ref(x):
    return x - x.mean().detach()


@equiv.equivalent_to(_centred_ref)
def centred(x: torch.Tensor):
    """A float read from the tensor: a graph break, the value an input of the resumed frame."""
    return x - x.mean().item()


def _counted_ref(x):
    return x * (x > 0).sum()


@equiv.equivalent_to(_counted_ref)
def counted(x: torch.Tensor):
    """An int read from the tensor (0 and 1 included)."""
    return x * int((x > 0).sum().item())


SCALAR_KERNELS = (centred, counted)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("targets", nargs="*", default=[str(ROOT / "examples")])
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inductor", action="store_true", help="add compile[inductor] (slow on CPU)")
    p.add_argument("--no-scalar", action="store_true", help="leave out the .item() kernels")
    args = p.parse_args(argv)
    return bench(args.targets, args.examples, args.seed, args.inductor, not args.no_scalar)


def bench(targets: list[str] | None = None, examples: int = 100, seed: int = 0,
          inductor: bool = False, scalar: bool = True) -> str:
    """The compilations table: (spec, backend) -> compilations over ``examples`` examples."""
    import hypothesis

    from equiv._loader import load_target
    from equiv.spec import get_spec

    backends = BACKENDS + (("compile[inductor]",) if inductor else ())
    cfg = equiv.settings(max_examples=examples, seed=seed,
                         hypothesis_settings=hypothesis.settings(database=None))
    specs = [s for t in (targets or [str(ROOT / "examples")]) for s in load_target(t)]
    specs += [get_spec(k) for k in SCALAR_KERNELS] if scalar else []
    rows, pinned, worst = [], [], 0
    for spec in specs:
        for mode in backends:
            start = time.perf_counter()
            report = equiv.check(spec, settings=cfg, modes=(mode,), raise_on_failure=False)
            wall = time.perf_counter() - start
            if mode not in report.modes:
                if spec.name not in pinned:
                    pinned.append(spec.name)
                continue
            (run,) = report.runs
            worst = max(worst, run.compilations or 0)
            reasons = "; ".join(getattr(run, "recompile_reasons", ())) or "-"
            rows.append(f"| {spec.name} | {mode} | {run.compilations} | {run.examples} | "
                        f"{run.status} | {wall:.1f} | {reasons} |")
    lines = [f"torch {torch.__version__}, {examples} examples per (spec, backend), "
             f"seed {seed}", "",
             "| spec | backend | compilations | examples | status | wall s | recompiled because |",
             "| --- | --- | ---: | ---: | --- | ---: | --- |", *rows, "",
             f"max compilations per (spec, backend): {worst} (goal <= 3)"]
    if pinned:
        lines.append(f"pinned to eager by their decorator: {', '.join(pinned)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
    sys.exit(0)
