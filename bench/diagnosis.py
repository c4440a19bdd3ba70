"""Diagnosis quality over planted bugs: root findings per bug and every cause line printed.

Each case is a kernel with one planted bug, written without looking at which check catches it
(a wrong backward term, a stale saved tensor, a missing ``mark_dirty``, a wrong module state map,
a bfloat16 accumulation, a wrong fake kernel...), plus the shipped ``examples/failing/``. For each
it runs ``equiv.check`` in eager and compile[aot_eager] and prints the number of root findings,
the follow-ons, and every "Likely cause" / "Fix" line, for review (bench/RESULTS.md).

    python bench/diagnosis.py [--seed 3] [--only NAME] [--modes eager,compile[aot_eager]]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from hypothesis import strategies as st
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import equiv  # noqa: E402
from equiv import equivalent_to  # noqa: E402
from equiv.strategies import tensors  # noqa: E402

F64 = torch.float64


# -- the planted bugs ---------------------------------------------------------------------------
class _XSinX(torch.autograd.Function):
    """x * sin(x) whose backward drops the product rule's second term."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sin(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sin(x)  # missing + x * cos(x)


class _EmaScale(torch.autograd.Function):
    """y = x * s, keeping ``s`` on ctx by reference; the caller then decays ``s`` in place."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s  # not save_for_backward: no version check
        return x * s

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class _ReluInplace(torch.autograd.Function):
    """relu_ written in place, without ctx.mark_dirty."""

    @staticmethod
    def forward(ctx, x):
        x.clamp_(min=0)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (y > 0)


class _SiluDetached(torch.autograd.Function):
    """silu saving the sigmoid computed in forward (no autograd history there): the double
    backward misses its derivative."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * s * (1 + x * (1 - s))


class _MulWrongSlot(torch.autograd.Function):
    """x * w whose backward checks the wrong needs_input_grad slot for w."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w if ctx.needs_input_grad[0] else None
        gw = g * x if ctx.needs_input_grad[0] else None  # should be [1]
        return gx, gw


class _AddcdivWrong(torch.autograd.Function):
    """a + b / c whose gradient for c forgets to square the divisor."""

    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(b, c)
        return torch.addcdiv(a, b, c)

    @staticmethod
    def backward(ctx, g):
        b, c = ctx.saved_tensors
        return g, g / c, -g * b / c  # should be / c**2


def _three(n: int = 3, dtype: torch.dtype = torch.float32) -> Any:
    t = tensors(shape=st.tuples(st.integers(1, 3), st.just(n)), dtype=dtype, requires_grad=True)
    return st.tuples(t, t, t.map(lambda c: (c.detach().abs() + 0.5).requires_grad_()))


@torch.library.custom_op("equiv_diag::rowsum", mutates_args=())
def rowsum_op(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1)


@rowsum_op.register_fake
def _(x):
    return torch.empty_like(x)  # wrong: the real kernel drops the last dim


class _ThreeProj(nn.Module):
    def __init__(self, dim: int, dtype: Any = None):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim, dtype=dtype) for _ in range(3))

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


class _FusedQKV(nn.Module):
    def __init__(self, dim: int, dtype: Any = None, transposed: bool = False):
        super().__init__()
        self.dim, self.transposed = dim, transposed
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)

    def forward(self, x):
        y = self.qkv(x)
        if self.transposed:  # splits the fused rows as (dim, 3) instead of (3, dim)
            y = y.unflatten(-1, (self.dim, 3)).movedim(-1, 0)
            return y[0], y[1], y[2]
        return tuple(t.clone() for t in y.split(self.dim, dim=-1))


def _qkv_state_swapped(sd: dict) -> dict:
    """A state map concatenating k before q (the module itself is right)."""
    return {"qkv.weight": torch.cat([sd["k.weight"], sd["q.weight"], sd["v.weight"]]),
            "qkv.bias": torch.cat([sd["k.bias"], sd["q.bias"], sd["v.bias"]])}


def _qkv_state(sd: dict) -> dict:
    return {"qkv.weight": torch.cat([sd["q.weight"], sd["k.weight"], sd["v.weight"]]),
            "qkv.bias": torch.cat([sd["q.bias"], sd["k.bias"], sd["v.bias"]])}


def _bf16_rowsum_ref(x):
    return x.float().sum(-1).to(x.dtype)


def _layer_norm_ref(x):
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def bugs() -> dict[str, Callable[[], Any]]:
    """name -> a builder of the buggy spec (built lazily: each registers its own spec)."""
    out: dict[str, Callable[[], Any]] = {}
    one = tensors(dtype=torch.float32, requires_grad=True)

    def reg(name: str):
        def deco(fn):
            out[name] = fn
            return fn
        return deco

    @reg("wrong backward term (x sin x)")
    def _():
        return equivalent_to(lambda x: x * torch.sin(x), inputs=st.tuples(one))(
            lambda x: _XSinX.apply(x))

    @reg("stale saved tensor (ctx.s then s.mul_)")
    def _():
        def ref(x, s):
            return x * s, s * 0.9

        def ema(x, s):
            y = _EmaScale.apply(x, s)
            s.mul_(0.9)
            return y, s
        st_s = tensors(shape=(3,), dtype=torch.float32)
        return equivalent_to(ref, mutates={"s": 1}, inputs=st.tuples(
            tensors(shape=(3,), dtype=torch.float32, requires_grad=True), st_s))(ema)

    @reg("missing mark_dirty (relu_)")
    def _():
        return equivalent_to(lambda x: torch.relu(x), mutates={"x": "out"})(
            lambda x: _ReluInplace.apply(x))

    @reg("double backward cut (silu, saved sigmoid)")
    def _():
        return equivalent_to(torch.nn.functional.silu, inputs=st.tuples(
            tensors(dtype=F64, requires_grad=True)))(lambda x: _SiluDetached.apply(x))

    @reg("needs_input_grad wrong slot")
    def _():
        return equivalent_to(lambda x, w: x * w)(lambda x, w: _MulWrongSlot.apply(x, w))

    @reg("addcdiv backward, divisor not squared")
    def _():
        return equivalent_to(torch.addcdiv, inputs=_three())(
            lambda a, b, c: _AddcdivWrong.apply(a, b, c))

    @reg("wrong fake kernel (custom op)")
    def _():
        return equivalent_to(lambda x: x.sum(-1), inputs=st.tuples(
            tensors(shape=(2, 3), dtype=torch.float32)))(lambda x: rowsum_op(x))

    @reg("wrong module state map (fused QKV)")
    def _():
        return equivalent_to(_ThreeProj, init=dict(dim=3, dtype=F64), state_map=_qkv_state_swapped,
                             input_shapes=(..., 3))(_FusedQKV)

    @reg("fused QKV, transposed split")
    def _():
        class Transposed(_FusedQKV):
            def __init__(self, dim, dtype=None):
                super().__init__(dim, dtype, transposed=True)
        return equivalent_to(_ThreeProj, init=dict(dim=3, dtype=F64), state_map=_qkv_state,
                             input_shapes=(..., 3))(Transposed)

    @reg("bf16 accumulation (row sum)")
    def _():
        def rowsum(x):
            acc = torch.zeros(x.shape[:-1], dtype=x.dtype)
            for i in range(x.shape[-1]):
                acc = acc + x[..., i]  # rounds to bfloat16 at every step
            return acc
        x = tensors(shape=st.tuples(st.integers(1, 3), st.integers(64, 200)),
                    dtype=torch.bfloat16, requires_grad=False)
        return equivalent_to(_bf16_rowsum_ref, inputs=st.tuples(x))(rowsum)

    @reg("layer norm, unbiased variance")
    def _():
        def ln(x):
            mu = x.mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=True) + 1e-5)
        x = tensors(shape=st.tuples(st.integers(1, 3), st.integers(2, 8)), dtype=torch.float32,
                    requires_grad=True)
        return equivalent_to(_layer_norm_ref, inputs=st.tuples(x))(ln)

    @reg("undeclared in-place write (silu_)")
    def _():
        return equivalent_to(torch.nn.functional.silu)(lambda x: x.mul_(torch.sigmoid(x)) if
                                                       not x.requires_grad else
                                                       torch.nn.functional.silu(x))

    @reg("fast path returns its input (aliasing)")
    def _():
        def relu(x):
            if bool((x >= 0).all()):
                return x  # the reference returns a new tensor
            return torch.relu(x)
        return equivalent_to(torch.relu)(relu)

    @reg("gelu tanh approximation")
    def _():
        return equivalent_to(torch.nn.functional.gelu)(
            lambda x: torch.nn.functional.gelu(x, approximate="tanh"))

    @reg("cache keyed by data_ptr")
    def _():
        cache: dict = {}

        def scaled(x):
            key = (x.data_ptr(), tuple(x.shape))
            if key not in cache:
                cache[key] = (x * 3).detach()
            return cache[key] + 0 * x
        return equivalent_to(lambda x: x * 3)(scaled)

    @reg("out= into a fresh buffer, gradient cut")
    def _():
        def square(x):
            buf = torch.empty_like(x)
            with torch.no_grad():
                torch.mul(x, x, out=buf)
            return buf
        return equivalent_to(lambda x: x * x)(square)
    return out


def failing_examples() -> dict[str, Callable[[], Any]]:
    """examples/failing/*.py: name -> builder (imports the file, returns its specs)."""
    out: dict[str, Callable[[], Any]] = {}
    for path in sorted((ROOT / "examples" / "failing").glob("*.py")):
        def build(path: Path = path) -> list:
            spec = importlib.util.spec_from_file_location(f"failing_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return [v for v in vars(mod).values() if hasattr(v, "__equiv_spec__")]
        out[f"examples/failing/{path.name}"] = build
    return out


# -- running -----------------------------------------------------------------------------------
def run_case(name: str, build: Callable[[], Any], modes: tuple[str, ...], seed: int) -> dict:
    built = build()
    targets = built if isinstance(built, list) else [built]
    findings = []
    for target in targets:
        report = equiv.check(target, modes=modes, seed=seed, raise_on_failure=False)
        findings.extend(report.findings)
    roots = [f for f in findings if f.caused_by is None]
    return {"name": name, "findings": len(findings), "roots": len(roots),
            "root_checks": [f"{f.check}({f.mode})" for f in roots],
            "causes": [(f.check, f.mode, f.likely_cause, f.fix) for f in findings
                       if f.likely_cause or f.fix]}


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--modes", default="eager,compile[aot_eager]")
    p.add_argument("--only", default="")
    p.add_argument("--causes", action="store_true", help="print every cause and fix line")
    args = p.parse_args(argv)
    modes = tuple(args.modes.split(","))
    cases = {**failing_examples(), **bugs()}
    rows = [run_case(n, b, modes, args.seed) for n, b in cases.items()
            if not args.only or args.only in n]
    lines = []
    for r in rows:
        lines.append(f"{r['roots']:>2} root(s) {r['findings']:>3} finding(s)  {r['name']}: "
                     + ", ".join(r["root_checks"]))
        if args.causes:
            for check, mode, cause, fix in r["causes"]:
                if cause:
                    lines.append(f"      [{check} {mode}] Likely cause: {cause}")
                if fix:
                    lines.append(f"      [{check} {mode}] Fix: {fix}")
    counts = [r["roots"] for r in rows]
    if counts:
        within = sum(c <= 2 for c in counts) / len(counts)
        lines.append(f"{len(counts)} cases: median roots {statistics.median(counts):g}, "
                     f"max {max(counts)}, {within:.0%} with at most 2, "
                     f"{sum(c == 0 for c in counts)} not caught")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
