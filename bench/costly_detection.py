"""Detection of the bugs only the costly checks see (schedules, the no-grad path, state across
calls, output stability, double backward), at the default profile, over seeds: how many seeds
find each bug, the median examples to the first failure and the median seconds to the report.

    python bench/costly_detection.py [--seeds 20]

Run it on two trees to compare ``settings(costly_share=...)`` (the costly checks on a drawn
share of the examples) with running them on every example.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import hypothesis
import torch

import equiv
from equiv import equivalent_to


class _StaleSave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.x = x  # saved by reference, outside save_for_backward
        return x * x

    @staticmethod
    def backward(ctx, g):
        return 2 * ctx.x * g


class _StashOnClass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        _StashOnClass.saved = x.detach().clone()  # shared by every call
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        return g * _StashOnClass.saved.cos()


class _PartlyDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s.detach())  # the detached intermediate breaks double backward
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * (s + x * s * (1 - s))


_WORKSPACE: dict[tuple, torch.Tensor] = {}
# the workspace bug returns a non-differentiable output: gradients are not its contract
_NO_GRADS = {"grads": False} if "grads" in inspect.signature(equivalent_to).parameters else {}


def _bugs() -> list[tuple[str, str, object]]:
    def stale(x):
        return _StaleSave.apply(x)

    def stash(x):
        return _StashOnClass.apply(x)

    def tanh_fast(x):
        if not torch.is_grad_enabled() or not x.requires_grad:
            return x.clamp(-1, 1)
        return torch.tanh(x)

    def scaled_cached(x, w):
        cached = getattr(w, "_softmax_cache", None)
        if cached is None:
            cached = w._softmax_cache = w.softmax(0)
        return x * cached

    def workspace(x):
        buf = _WORKSPACE.setdefault((tuple(x.shape), x.dtype), torch.empty_like(x))
        return torch.mul(x.detach(), 2, out=buf)

    def silu(x):
        return _PartlyDifferentiable.apply(x)

    return [
        ("stale saved input (mutate-after-forward)", "schedule",
         equivalent_to(lambda x: x * x, name="cd.stale")(stale)),
        ("state stashed on the Function class (interleaved forwards)", "schedule",
         equivalent_to(torch.sin, name="cd.stash")(stash)),
        ("wrong no-grad fast path", "no-grad",
         equivalent_to(torch.tanh, name="cd.tanh_fast")(tanh_fast)),
        ("cache keyed by tensor identity", "state-across-calls",
         equivalent_to(lambda x, w: x * w.softmax(-1), name="cd.cached")(scaled_cached)),
        ("reused output workspace", "output-stability",
         equivalent_to(lambda x: x * 2, name="cd.workspace", **_NO_GRADS)(workspace)),
        ("partly differentiable backward", "double-backward",
         equivalent_to(lambda x: x * torch.sigmoid(x), name="cd.silu")(silu)),
    ]


def bench(seeds: int = 20) -> str:
    rows = ["| bug | check | found (of seeds) | by that check | median examples to first "
            "failure | median s to report |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for label, check, fn in _bugs():
        found = by = 0
        firsts, secs = [], []
        for seed in range(seeds):
            cfg = equiv.settings(seed=seed, modes=("eager",),
                                 hypothesis_settings=hypothesis.settings(database=None))
            start = time.perf_counter()
            report = equiv.check(fn, settings=cfg, raise_on_failure=False)
            secs.append(time.perf_counter() - start)
            if not report.ok:
                found += 1
                by += any(f.check == check for f in report.findings)
                if report.first_failure_at:
                    firsts.append(report.first_failure_at)
        med = statistics.median(firsts) if firsts else "-"
        rows.append(f"| {label} | {check} | {found}/{seeds} | {by}/{seeds} | {med} | "
                    f"{statistics.median(secs):.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, default=20)
    return bench(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    print(main())
