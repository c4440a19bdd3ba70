"""Detection of the contract checks: each buggy implementation must be found by its check within
the default 60 examples on every seed. Prints one line per case: seeds caught / seeds run and the
median / worst example index of the first failure.

    python bench/contracts_detection.py [--seeds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hypothesis  # noqa: E402
import torch  # noqa: E402

import equiv  # noqa: E402
from tests import test_contracts as tc  # noqa: E402  (the buggy twins live with their tests)


def _cases():
    cases = []

    @equiv.equivalent_to(lambda x: x.t(), inputs=tc.one())
    def t_copy(x):
        return x.t().contiguous()
    cases.append(("aliasing: copy for a view", t_copy, "aliasing"))

    @equiv.equivalent_to(torch.relu, mutates={"x": "out"}, inputs=tc.one())
    def relu_tmp_(x):
        out = torch.relu(x)
        x.copy_(out)
        return out
    cases.append(("aliasing: in-place returns a temporary", relu_tmp_, "aliasing"))

    @equiv.equivalent_to(tc.index_add_ref, mutates={"x": "out"}, inputs=tc._index_inputs())
    def index_add_rows_(x, idx, src):
        for i, j in enumerate(idx.tolist()):
            if j >= x.shape[0]:
                raise IndexError("index out of range")
            x[j] += src[i]
        return x
    cases.append(("error-parity: partial write", index_add_rows_, "error-parity"))

    @equiv.equivalent_to(tc.checked_log_ref, inputs=tc._POSITIVE, error_inputs=tc._NEGATIVE,
                         raises=ValueError, match="non-positive")
    def log_bad_message(x):
        if bool((x <= 0).any()):
            raise ValueError("bad input")
        return x.log()
    cases.append(("error-parity: error_inputs message", log_bad_message, "error-parity"))

    @equiv.equivalent_to(torch.tanh, inputs=tc.one())
    def tanh_fast(x):
        if not torch.is_grad_enabled() or not x.requires_grad:
            return x.clamp(-1, 1)
        return torch.tanh(x)
    cases.append(("no-grad: wrong fast path", tanh_fast, "no-grad"))

    equiv.equivalent_to(torch.sin, inputs=tc.one())(tc.StashOnClass)
    cases.append(("schedule: interleaved forwards", tc.StashOnClass, "schedule"))

    @equiv.equivalent_to(tc._scaled_ref, inputs=tc._xw())
    def scaled_cached(x, w):
        cached = getattr(w, "_softmax_cache", None)
        if cached is None:
            cached = w._softmax_cache = w.softmax(0)
        return x * cached
    cases.append(("state-across-calls: identity cache", scaled_cached, "state-across-calls"))

    equiv.equivalent_to(torch.sin, inputs=tc.one())(tc.SavesWorkspaceView)
    cases.append(("memory: default bound", tc.SavesWorkspaceView, "memory"))
    return cases


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--max-examples", type=int, default=60)
    a = p.parse_args()
    for label, impl, check in _cases():
        firsts = []
        for seed in range(a.seeds):
            cfg = equiv.settings(max_examples=a.max_examples, seed=seed,
                                 hypothesis_settings=hypothesis.settings(database=None))
            r = equiv.check(impl, settings=cfg, raise_on_failure=False)
            if any(f.check == check for f in r.findings):
                firsts.append(r.first_failure_at or 0)
        worst = max(firsts) if firsts else "-"
        med = statistics.median(firsts) if firsts else "-"
        print(f"{label:<42} {check:<20} {len(firsts)}/{a.seeds}  first failure median {med} "
              f"worst {worst}", flush=True)


if __name__ == "__main__":
    main()
