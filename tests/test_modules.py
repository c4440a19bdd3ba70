"""nn.Module pairs (equiv.modules): buggy modules caught with the finding, parameter and
message; correct twins pass; registration errors name the keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import equiv
from equiv import equivalent_to
from tests.conftest import FAST

EAGER = equiv.settings(max_examples=25, seed=1234, modes=("eager",),
                       hypothesis_settings=FAST.hypothesis_settings)
F64 = torch.float64


def _run(cls):
    return equiv.check(cls, settings=EAGER, raise_on_failure=False)


# -- a fused norm with a hand-written backward ------------------------------------------------
def _norm(reduce_all_leading: bool):
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            mean = x.mean(-1, keepdim=True)
            rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
            xhat = (x - mean) * rstd
            ctx.save_for_backward(xhat, rstd, w)
            return xhat * w + b

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            xhat, rstd, w = ctx.saved_tensors
            lead = tuple(range(g.dim() - 1)) if reduce_all_leading else (0,)
            gw = (g * xhat).sum(lead)
            if not reduce_all_leading:
                gw = gw[0]  # bug: reduced over dim 0 only, then the first row taken
            gx = g * w
            gx = rstd * (gx - gx.mean(-1, keepdim=True) - xhat * (gx * xhat).mean(-1, keepdim=True))
            return gx, gw, g.sum(tuple(range(g.dim() - 1)))

    class Norm(nn.Module):
        def __init__(self, normalized_shape, dtype=None):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(normalized_shape, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(normalized_shape, dtype=dtype))

        def forward(self, input):
            return Fn.apply(input, self.weight, self.bias)

    return equivalent_to(nn.LayerNorm, init=dict(normalized_shape=4, dtype=F64),
                         input_shapes=(None, 3, 4))(Norm)


def test_fused_norm_correct_twin_passes():
    assert _run(_norm(True)).ok


def test_fused_norm_weight_gradient_over_wrong_dims_is_caught():
    report = _run(_norm(False))
    f = next(f for f in report.findings if f.check == "gradients")
    assert f.argument == "params['weight']"
    assert f.headline == "gradient w.r.t. \"params['weight']\" differs from the reference on backward #1."
    with pytest.raises(equiv.GradientMismatch):
        report.raise_if_failed()


# -- BatchNorm-style buffers ------------------------------------------------------------------
def _bn(*, biased=False, count=True, eval_batch_stats=False):
    class BN(nn.Module):
        def __init__(self, num_features, dtype=None):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(num_features, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(num_features, dtype=dtype))
            self.register_buffer("running_mean", torch.zeros(num_features, dtype=dtype))
            self.register_buffer("running_var", torch.ones(num_features, dtype=dtype))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

        def forward(self, input):
            n = input.shape[0]
            if self.training or eval_batch_stats:
                if n < 2:
                    raise ValueError("Expected more than 1 value per channel when training")
                mean, var = input.mean(0), input.var(0, unbiased=False)
            else:
                mean, var = self.running_mean, self.running_var
            if self.training:
                with torch.no_grad():
                    unbiased = var if biased else var * (n / (n - 1))
                    self.running_mean.mul_(0.9).add_(mean, alpha=0.1)
                    self.running_var.mul_(0.9).add_(unbiased, alpha=0.1)
                    if count:
                        self.num_batches_tracked.add_(1)
            return (input - mean) * torch.rsqrt(var + 1e-5) * self.weight + self.bias

    return equivalent_to(nn.BatchNorm1d, init=dict(num_features=3, dtype=F64),
                         input_shapes=(None, 3))(BN)


def test_batchnorm_correct_twin_passes():
    assert _run(_bn()).ok


@pytest.mark.parametrize("bug, buffer", [(dict(biased=True), "running_var"),
                                         (dict(count=False), "num_batches_tracked")])
def test_batchnorm_buffer_update_bugs_are_caught(bug, buffer):
    report = _run(_bn(**bug))
    f = next(f for f in report.findings if f.check == "mutation")
    assert f.argument == f"buffers[{buffer!r}]"
    assert f.headline == (f"the final value of mutated argument \"buffers[{buffer!r}]\" differs "
                          "from the reference.")
    assert "training=True" in f.example


def test_batch_statistics_in_eval_mode_are_caught():
    report = _run(_bn(eval_batch_stats=True))
    f = next(f for f in report.findings if f.check == "forward")
    assert "training=False" in f.example
    assert "differs from the reference" in f.headline


# -- fused QKV against three projections ------------------------------------------------------
class ThreeProj(nn.Module):
    def __init__(self, dim, dtype=None):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim, dtype=dtype) for _ in range(3))

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


def qkv_state(sd):
    return {"qkv.weight": torch.cat([sd["q.weight"], sd["k.weight"], sd["v.weight"]]),
            "qkv.bias": torch.cat([sd["q.bias"], sd["k.bias"], sd["v.bias"]])}


def _qkv(transposed: bool):
    class FusedQKV(nn.Module):
        def __init__(self, dim, dtype=None):
            super().__init__()
            self.dim = dim
            self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)

        def forward(self, x):
            y = self.qkv(x)
            if transposed:  # bug: splits the fused rows as (dim, 3) instead of (3, dim)
                y = y.unflatten(-1, (self.dim, 3)).movedim(-1, 0)
                return y[0], y[1], y[2]
            # views of one buffer would be an aliasing finding (a write to q changes k)
            return tuple(t.clone() for t in y.split(self.dim, dim=-1))

    return equivalent_to(ThreeProj, init=dict(dim=3, dtype=F64), state_map=qkv_state,
                         input_shapes=(..., 3))(FusedQKV)


def test_fused_qkv_with_state_map_passes():
    assert _run(_qkv(False)).ok


def test_fused_qkv_transposed_split_is_caught():
    report = _run(_qkv(True))
    f = report.findings[0]
    assert f.check == "forward"
    assert f.headline.startswith("output[") and "differs from the reference" in f.headline


def test_state_dict_that_does_not_load_names_the_keys():
    with pytest.raises(equiv.InvalidArgument, match=r"missing keys \['qkv.bias', 'qkv.weight'\], "
                       r"unexpected keys \['k.bias', 'k.weight', 'q.bias', 'q.weight', "):
        equivalent_to(ThreeProj, init=dict(dim=3))(_qkv_class())


def _qkv_class():
    class FusedQKV(nn.Module):
        def __init__(self, dim, dtype=None):
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)

        def forward(self, x):
            return tuple(self.qkv(x).chunk(3, -1))

    return FusedQKV


def test_unknown_module_option_is_rejected():
    with pytest.raises(equiv.InvalidArgument, match="unexpected keyword argument"):
        equivalent_to(nn.LayerNorm, init=dict(normalized_shape=3), shapes=(3,))


# -- names, pytest items, CLI, printed code ---------------------------------------------------
def test_spec_name_and_printed_code_rebuild_the_module():
    cls = _bn(biased=True)
    spec = cls.__equiv_spec__
    assert spec.name.endswith("BN")
    code = spec.impl.__equiv_code__(_example_of(spec))
    assert "ref = BatchNorm1d(num_features=3, dtype=torch.float64)" in code
    assert "ref.load_state_dict(state)" in code


def _example_of(spec):
    from hypothesis import find

    return find(spec.inputs, lambda a: a.kwargs["training"])


def test_pytest_items_and_cli_rows_look_like_function_specs():
    import importlib.util
    import pathlib
    import subprocess
    import sys

    from equiv.pytest import tests_for

    path = pathlib.Path(__file__).parent.parent / "examples" / "fused_layernorm.py"
    mod_spec = importlib.util.spec_from_file_location("fused_layernorm_t", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    items = tests_for(mod.FusedLayerNorm)
    assert "FusedLayerNorm" in repr(items) or items is not None
    out = subprocess.run([sys.executable, "-m", "equiv", "check", str(path), "--modes", "eager",
                          "--max-examples", "10"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fused_layernorm.FusedLayerNorm" in out.stdout and "pass" in out.stdout
