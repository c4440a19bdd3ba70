"""Overhead of equiv's check(): its wall time ÷ just executing impl and ref (forward + 2
backwards each) on the same number of examples. Two raws:

- *drawn*: the examples the input strategy draws (contiguous tensors, contiguous cotangents);
- *executed*: the examples check() executed, as it executed them: the input variants applied
  (transposed, sliced, offset, expanded and aliased arguments, built as equiv builds them) and
  each example's cotangent layout (strided, transposed, expanded, zero). A kernel on a sliced
  argument of three times the storage, or with a transposed cotangent, costs more than on a
  contiguous one: that is the kernel's cost on the example, not equiv's.

Each round times the raws and check() back to back (the order alternates between rounds, so
load on a shared machine hits all alike); the table shows the medians over the rounds and the
median of the per-round ratios.

Two floors beside them, each / raw drawn: *drawing only* is check()'s own Hypothesis test with a
body that does nothing (inputs, variants, cotangent seed and layout drawn); *engine only* is
Hypothesis running a body-less test that draws as many plain integers per example as check()'s
test makes choices (the engine's own cost per example, whatever equiv draws).
``--costly-share`` runs check() with ``settings(costly_share=...)`` (default: the profile's).

    python bench/overhead.py [--examples N] [--sizes 1000,1000000] [--rounds 5] [--device cpu]
                             [--costly-share 0.25]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import hypothesis
import hypothesis.strategies as st
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import equiv  # noqa: E402
from equiv import equivalent_to  # noqa: E402
from equiv.examples import Template  # noqa: E402
from equiv.strategies import tensors  # noqa: E402
from equiv.variants import CONTIGUOUS  # noqa: E402
from functions import ScaledTanh, scaled_tanh_ref  # noqa: E402

_NAMES = itertools.count()


def relu_ref(x):
    return torch.relu(x)


def relu_(x):
    return x.clamp_(min=0)


def rms_ref(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rms_fused(x, w):
    return torch.rms_norm(x, (x.shape[-1],), w, 1e-6)


@dataclass(frozen=True)
class Case:
    """One benchmarked implementation: ``impl`` is what the spec decorates, ``call`` runs it."""

    label: str
    impl: Any
    call: Callable[..., torch.Tensor]
    ref: Callable[..., torch.Tensor]
    mutates: dict | None
    arity: int


CASES = [
    Case("relu_ (in place)", relu_, relu_, relu_ref, {"x": "out"}, 1),
    Case("rms_norm", rms_fused, rms_fused, rms_ref, None, 2),
    Case("custom Function (scaled tanh)", ScaledTanh, ScaledTanh.apply, scaled_tanh_ref, None, 1),
]


def _shape(numel: int) -> tuple[int, int]:
    cols = 1000 if numel >= 10_000 else 10
    return (max(numel // cols, 1), cols)


def _inputs(arity: int, shape) -> st.SearchStrategy:
    return st.tuples(*[tensors(shape=shape if i == 0 else shape[-1:], dtype=torch.float32,
                               requires_grad=True, salt=i) for i in range(arity)])


def draw_examples(strategy: st.SearchStrategy, n: int) -> list[tuple[torch.Tensor, ...]]:
    """``n`` examples drawn from ``strategy`` (the one check() draws from), detached copies."""
    drawn: list = []

    @hypothesis.settings(max_examples=n, database=None, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(strategy)
    def collect(ex):
        if len(drawn) < n:
            drawn.append(tuple(t.detach().clone() for t in ex))

    collect()
    while len(drawn) < n:  # a strategy with fewer distinct examples: repeat them
        drawn.append(drawn[len(drawn) % max(len(drawn), 1)])
    return drawn


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def raw_time(case: Case, examples, device: str = "cpu") -> float:
    """impl and ref forward + 2 backwards each (retain_graph) on every example."""
    _sync(device)
    start = time.perf_counter()
    for ex in examples:
        for fn in (case.call, case.ref):
            leaves = [t.clone().requires_grad_() for t in ex]
            first = leaves[0].clone() if (case.mutates and fn is case.call) else leaves[0]
            out = fn(first, *leaves[1:])
            cot = torch.randn_like(out)
            torch.autograd.grad(out, leaves, cot, retain_graph=True)
            torch.autograd.grad(out, leaves, cot)
    _sync(device)
    return time.perf_counter() - start


def executed_examples(fn, n: int, device: str = "cpu") -> list[tuple[Template, Any]]:
    """The valid examples check() executes on ``n`` examples, as (template, cotangent variant):
    the input variants applied, as check() built them."""
    import equiv.run as run

    seen: list[tuple[Template, Any]] = []
    real = run.execute_example

    def spy(spec, cfg, args, cot_seed, state, device_, **options):
        outcome = real(spec, cfg, args, cot_seed, state, device_, **options)
        if outcome.invalid is None and outcome.template is not None:
            seen.append((outcome.template, options.get("cotangent", CONTIGUOUS)))
        return outcome

    run.execute_example = spy
    try:
        check_time(fn, n, device)
    finally:
        run.execute_example = real
    return seen


def raw_executed_time(case: Case, executed: list[tuple[Template, Any]],
                      device: str = "cpu") -> float:
    """:func:`raw_time` on the examples check() executed: each argument built as check() built
    it (strides, storage offsets, aliasing), the cotangent in the example's layout (drawn
    contiguous, as :func:`raw_time`'s: ``randn_like`` of a transposed output costs ~10x)."""
    _sync(device)
    start = time.perf_counter()
    for template, cot_variant in executed:
        for fn in (case.call, case.ref):
            side = template.instantiate(device=device)
            leaves = [t for t in side.leaves if t is not None]
            out = side.call(fn)
            values = torch.randn(out.shape, dtype=out.dtype, device=out.device)  # as raw_time's
            (cot,) = cot_variant.lay_out(cot_variant.values([values]))
            torch.autograd.grad(out, leaves, cot, retain_graph=True)
            torch.autograd.grad(out, leaves, cot)
    _sync(device)
    return time.perf_counter() - start


#: ``settings(costly_share=...)`` for check() (None: the profile's)
COSTLY_SHARE: list[float | None] = [None]


def check_time(fn, n: int, device: str = "cpu", **options: Any) -> tuple[float, int]:
    """Wall time of check() on ``n`` examples and the examples it ran (``options``: more
    settings)."""
    share = {} if COSTLY_SHARE[0] is None else {"costly_share": COSTLY_SHARE[0]}
    cfg = equiv.settings(max_examples=n, seed=0, modes=("eager",), devices=(device,),
                         hypothesis_settings=hypothesis.settings(database=None),
                         **{**share, **options})
    _sync(device)
    start = time.perf_counter()
    report = equiv.check(fn, settings=cfg)
    _sync(device)
    return time.perf_counter() - start, report.examples_run


def draw_time(fn, n: int, device: str = "cpu") -> tuple[float, int]:
    """Wall time of check()'s own Hypothesis test drawing ``n`` examples (inputs, variants,
    cotangent seed and layout) with a body that does nothing: the floor of any check(); and
    the median number of choices it makes per example."""
    from hypothesis.control import current_build_context

    from equiv.spec import get_spec
    from equiv.modes import parse_mode
    from equiv.run import _hypothesis_test

    cfg = equiv.settings(max_examples=n, seed=0, modes=("eager",), devices=(device,),
                         hypothesis_settings=hypothesis.settings(database=None))
    choices: list[int] = []
    test = _hypothesis_test(get_spec(fn), cfg, parse_mode("eager"), device, 0,
                            lambda *drawn: choices.append(
                                len(current_build_context().data.choices)))
    start = time.perf_counter()
    test()
    return time.perf_counter() - start, int(statistics.median(choices or [0]))


def engine_time(choices: int, n: int) -> float:
    """Wall time of Hypothesis running a body-less test of ``n`` examples that draws
    ``choices`` plain integers each: the engine's own cost, whatever is drawn."""
    @hypothesis.settings(max_examples=n, database=None, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.tuples(*[st.integers(0, 2**31 - 1)] * max(choices, 1)))
    def bare(drawn):
        pass

    start = time.perf_counter()
    bare()
    return time.perf_counter() - start


def measure(case: Case, shape, n: int, rounds: int, device: str = "cpu") -> dict:
    """Interleaved rounds of raw and check() on ``case``: medians and the median ratio."""
    strategy = _inputs(case.arity, shape)
    fn = equivalent_to(case.ref, mutates=case.mutates, inputs=strategy,
                       name=f"bench.overhead.{next(_NAMES)}")(case.impl)
    _, ran = check_time(fn, n, device)  # warm-up, and how many examples check() runs
    executed = executed_examples(fn, n, device)
    examples = [tuple(t.to(device) for t in ex) for ex in draw_examples(strategy, max(ran, 1))]
    raw_time(case, examples[:1], device)  # warm-up
    raw_executed_time(case, executed[:1], device)
    raws, execs, checks, draws, engines = [], [], [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            raws.append(raw_time(case, examples, device))
            execs.append(raw_executed_time(case, executed, device))
            checks.append(check_time(fn, n, device)[0])
        else:
            checks.append(check_time(fn, n, device)[0])
            execs.append(raw_executed_time(case, executed, device))
            raws.append(raw_time(case, examples, device))
        drawn_s, choices = draw_time(fn, ran, device)
        draws.append(drawn_s)
        engines.append(engine_time(choices, ran))
    return {"examples": ran, "check": statistics.median(checks), "raw": statistics.median(raws),
            "ratio": statistics.median(c / r for c, r in zip(checks, raws)),
            "executed": statistics.median(execs),
            "executed ratio": statistics.median(c / r for c, r in zip(checks, execs)),
            "draw ratio": statistics.median(d / r for d, r in zip(draws, raws)),
            "engine ratio": statistics.median(e / r for e, r in zip(engines, raws)),
            "choices": choices}


def bench(examples: int = 20, sizes: tuple[int, ...] = (1000, 1_000_000), rounds: int = 5,
          device: str = "cpu") -> str:
    """The overhead table (markdown) for every case at every size."""
    rows = [f"{rounds} interleaved rounds per row, device {device}, eager, default checks; "
            "ratio = median over rounds of check() / raw (drawn: the strategy's examples; "
            "executed: the examples check() executed, variants and cotangent layouts "
            "included); drawing only = check()'s Hypothesis test drawing the same number of "
            "examples with an empty body, / raw drawn; engine only = Hypothesis drawing as many "
            "plain integers per example as that test makes choices, empty body, / raw drawn"
            + ("" if COSTLY_SHARE[0] is None else f"; settings(costly_share={COSTLY_SHARE[0]:g})"),
            "",
            "| case | elements | examples | check() s | raw drawn s | ratio (drawn) "
            "| raw executed s | ratio (executed) | drawing only | engine only (choices) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for numel in sizes:
        shape = _shape(numel)
        n = examples if numel < 100_000 else max(examples // 4, 3)
        for case in CASES:
            m = measure(case, shape, n, rounds, device)
            rows.append(f"| {case.label} | {shape[0] * shape[1]:,} | {m['examples']} | "
                        f"{m['check']:.3f} | {m['raw']:.3f} | {m['ratio']:.1f}x | "
                        f"{m['executed']:.3f} | {m['executed ratio']:.1f}x | "
                        f"{m['draw ratio']:.1f}x | {m['engine ratio']:.1f}x ({m['choices']}) |")
    table = "\n".join(rows)
    print(table)
    return table


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--examples", type=int, default=20)
    p.add_argument("--sizes", default="1000,1000000")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--costly-share", type=float, default=None,
                   help="settings(costly_share=...) for check() (default: the profile's)")
    args = p.parse_args(argv)
    COSTLY_SHARE[0] = args.costly_share
    return bench(args.examples, tuple(int(s) for s in args.sizes.split(",")), args.rounds,
                 args.device)


if __name__ == "__main__":
    main()
