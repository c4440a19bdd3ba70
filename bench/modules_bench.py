"""Cost per example of a module spec against the raw forward+backward of both modules.

    python bench/modules_bench.py [--examples 20] [--repeats 5]

For examples/fused_layernorm.py and examples/inplace_batchnorm.py: time of ``equiv.check`` in
eager mode divided by the examples run, against one forward+backward of the implementation
module and of the reference module on an input of the drawn size; interleaved, median of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import time

import hypothesis
import torch

import equiv

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _raw(impl: torch.nn.Module, ref: torch.nn.Module, shape: tuple[int, ...]) -> float:
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    t = time.perf_counter()
    for m in (impl, ref):
        m(x).sum().backward()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    cases = [(_load("fused_layernorm").FusedLayerNorm, torch.nn.LayerNorm,
              dict(normalized_shape=16, dtype=torch.float64), (3, 16)),
             (_load("inplace_batchnorm").InplaceBatchNorm, torch.nn.BatchNorm1d,
              dict(num_features=3, dtype=torch.float64), (4, 3))]
    cfg = equiv.settings(max_examples=a.examples, seed=0, modes=("eager",),
                         hypothesis_settings=hypothesis.settings(database=None))
    print(f"{'module':22} {'spec s/example':>15} {'raw fwd+bwd s':>14} {'ratio':>8}")
    for impl_cls, ref_cls, init, shape in cases:
        per_ex, raw = [], []
        impl, ref = impl_cls(**init), ref_cls(**init)
        for _ in range(a.repeats):  # interleaved
            t = time.perf_counter()
            r = equiv.check(impl_cls, settings=cfg)
            per_ex.append((time.perf_counter() - t) / max(r.examples_run, 1))
            raw.append(statistics.median(_raw(impl, ref, shape) for _ in range(20)))
        s, w = statistics.median(per_ex), statistics.median(raw)
        print(f"{impl_cls.__name__:22} {s:15.4f} {w:14.6f} {s / w:8.0f}")


if __name__ == "__main__":
    main()
