"""Recorder overhead: time of forward + backward under equiv.timeline.Recorder / without it.

    python bench/recorder_bench.py [--repeats N]

Workload: a small MLP-like chain (matmul, tanh, in-place add, a view) plus a custom Function
with a ctx attribute, on small, medium and large tensors. Prints the best time of N interleaved
runs (robust on a loaded machine) and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from equiv.timeline import Recorder


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.x = x  # a stash the recorder has to find
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _workload(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    h = h + 1.0
    h.mul_(0.5)
    v = h[:, : h.shape[1] // 2]
    return _Scale.apply(v).sin()


def _once(x: torch.Tensor, w: torch.Tensor, record: bool) -> float:
    start = time.perf_counter()
    if record:
        rec = Recorder()
        rec.name(x, "x")
        rec.name(w, "w")
        with rec:
            y = _workload(x, w)
            rec.after_forward([y])
            rec.phase("backward #1")
            torch.autograd.grad(y, (x, w), torch.ones_like(y))
    else:
        y = _workload(x, w)
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
    return time.perf_counter() - start


def bench(repeats: int = 30) -> None:
    """Print the with/without recorder times, best of ``repeats`` interleaved runs."""
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"best of {repeats} interleaved runs")
    for label, n in (("small", 8), ("medium", 256), ("large", 768)):
        x = torch.randn(n, n, requires_grad=True)
        w = torch.randn(n, n, requires_grad=True)
        for record in (False, True):  # warm up
            _once(x, w, record)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):  # interleaved, so machine load hits both alike
            for record in (False, True):
                times[record].append(_once(x, w, record))
        plain, recorded = min(times[False]), min(times[True])  # best of N: robust to load
        print(f"{label:>6} {n}x{n}: without {plain * 1e3:8.3f} ms   with recorder "
              f"{recorded * 1e3:8.3f} ms   ratio {recorded / plain:6.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    bench(parser.parse_args(argv).repeats)


if __name__ == "__main__":
    main()
