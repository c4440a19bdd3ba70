"""Real code: equiv over PyTorch's own (ATen kernel, Python reference) pairs, default profile.

Each pair is an ATen kernel (functional or in-place) against a Python reference torch ships:
``torch._refs`` / ``torch._refs.nn.functional``, or ``torch._decomp.decomposition_table[op]``.
No tolerance and no ``variants=`` option: the point is equiv's default behaviour on code it did
not write. ``inputs=`` only where the signature needs shapes the op accepts. One row per pair:
``pass``, ``FAIL`` (each finding's check and headline) or ``ERROR``, with wall time. Each
finding of a non-pass is looked up by (pair, check) in ``KNOWN_REAL`` (confirmed PyTorch
discrepancies, reproduced without equiv in ``bench/realcode_repros.py``) and ``FALSE_ALARMS``
(equiv's own, diagnosed in bench/RESULTS.md); a row with any other finding is
``unclassified``.

    python bench/realcode.py --examples 30 --json out.json
    python bench/realcode.py --quick                       # 3 pairs, 4 examples
    python bench/realcode.py --only relu_,layer_norm --modes eager,compile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import warnings  # noqa: E402

import hypothesis  # noqa: E402
import torch  # noqa: E402
import torch._decomp as _decomp  # noqa: E402
import torch._refs as R  # noqa: E402
import torch._refs.nn.functional as RF  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import equiv  # noqa: E402
from equiv import Args, equivalent_to  # noqa: E402
from equiv.strategies import tensors  # noqa: E402

aten = torch.ops.aten
DECOMP = _decomp.decomposition_table

#: findings confirmed as discrepancies in PyTorch (reproduced in bench/realcode_repros.py):
#: pair -> {check: reason}
KNOWN_REAL: dict[str, dict[str, str]] = {
    "group_norm": {
        "forward": "_refs.group_norm calls CPU native_group_norm, which reads a stride-0 weight "
                   "as contiguous (the reference is the wrong side)",
        "repeated-backward": "the same stride-0 weight bug in native_group_norm's backward",
        "gradients": "the same stride-0 weight bug in native_group_norm's backward",
        "error-parity": "F.group_norm raises on one value per group; the reference returns"},
    "native_group_norm": {
        "error-parity": "F.group_norm raises on one value per group; the decomposition returns"},
    "batch_norm_train": {
        "gradients": "the native_batch_norm decomposition leaves the updated running stats "
                     "requiring grad under eager autograd (the reference is the wrong side)"},
    "batch_norm_eval": {
        "gradients": "CPU eval batch_norm backward with a stride-0 weight reads garbage"},
    "pad": {"gradients": "_refs.constant_pad_nd cuts x out of the graph (grad None)"},
    "addcdiv_": {
        "gradients": "float16 addcdiv_ backward w.r.t. tensor2 overflows tensor1 / tensor2**2 "
                     "to inf before the grad scales it",
        "repeated-backward": "the same float16 overflow (inf where the reference is finite)"},
    "logsumexp": {
        "forward": "CPU float16 logsumexp rounds its sum in float16: 103 ulps (6%) from "
                   "float64 where _refs is within 0.5",
        "gradients": "the same float16 rounding, through exp(x - lse)",
        "repeated-backward": "the same float16 rounding, through exp(x - lse)"},
    "elu_": {
        "gradients": "float16 elu_ (in place) takes its backward from the rounded result: "
                     "result + alpha cancels for x << 0, 12 float16 ulps from exp(x) at "
                     "x = -4.36 where _refs (from x) is within 1",
        "repeated-backward": "the same float16 cancellation in elu_'s backward"},
    "vector_norm": {
        "forward": "CPU vector_norm of a stride-0 float32 input: ~25 eps relative error, "
                   "1.6 eps for the same values contiguous",
        "gradients": "the same inaccurate norm, through x / norm"},
}

#: findings diagnosed as equiv's own false alarms on this tree (bench/RESULTS.md says which
#: rule): pair -> {check: rule}; a rerun marks them "false alarm" so fixed ones are visible
FALSE_ALARMS: dict[str, dict[str, str]] = {
    "softmax": {"gradients": "finite differences: no float32 rounding allowance"},
    "var_correction0": {"gradients": "finite differences: the rounding allowance takes the "
                                     "implementation's gradient terms, which cancel exactly in "
                                     "float64 (x - mean of an expanded constant)"},
    "var_correction2": {"gradients": "finite differences: NaN against NaN"},
    "batch_norm_eval": {"error-parity": "aliasing variant: running_mean made the same tensor "
                                        "as the grad-requiring weight"},
    "bce_with_logits": {"error-parity": "aliasing variant: constant weight aliased with x"},
    "nll_loss": {"error-parity": "aliasing variant: constant weight aliased with x"},
    "nll_loss_forward": {"error-parity": "aliasing variant: constant weight aliased with x"},
    "cross_entropy": {"error-parity": "aliasing variant: constant weight aliased with x"},
}


@dataclasses.dataclass(frozen=True)
class Pair:
    """One (kernel, reference) pair: ``impl``/``ref`` take the same arguments."""

    label: str
    impl: Callable[..., Any]
    ref: Callable[..., Any]
    mutates: dict | None = None
    inputs: Callable[[], Any] | None = None  # builds the strategy (None: from the signature)
    source: str = ""  # which reference


# -- input strategies for ops whose signature needs shapes --------------------------------------

_FLOAT = st.sampled_from((torch.float32, torch.float64))


def _t(draw: Any, shape: tuple[int, ...], dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    return draw(tensors(shape=shape, dtype=dtype, requires_grad=grad))


def _side(lo: int = 1, hi: int = 5) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


@st.composite
def _rows_affine(draw: Any) -> Args:
    """x (B, N) and an affine weight and bias (N,): layer_norm, rms_norm."""
    dt, b, n = draw(_FLOAT), draw(_side()), draw(_side())
    return Args(_t(draw, (b, n), dt), _t(draw, (n,), dt), _t(draw, (n,), dt))


@st.composite
def _groups(draw: Any) -> Args:
    """x (B, C, L) with C = G * k channels, weight and bias (C,): group_norm with G groups."""
    dt, b, g, k, n = draw(_FLOAT), draw(_side()), draw(_side(1, 3)), draw(_side(1, 3)), draw(_side())
    c = g * k
    return Args(_t(draw, (b, c, n), dt), _t(draw, (c,), dt), _t(draw, (c,), dt), groups=g)


@st.composite
def _batch_norm(draw: Any) -> Args:
    """x (B, C, L), weight and bias (C,), running mean and positive running var (C,)."""
    dt, b, c, n = draw(_FLOAT), draw(_side(2, 4)), draw(_side()), draw(_side())
    mean = _t(draw, (c,), dt, grad=False)
    var = _t(draw, (c,), dt, grad=False).abs() + 0.5
    return Args(_t(draw, (b, c, n), dt), _t(draw, (c,), dt), _t(draw, (c,), dt), mean, var)


@st.composite
def _logits_targets(draw: Any) -> Args:
    """logits (B, C), targets in [0, 1], a per-element weight and a per-class pos_weight."""
    dt, b, c = draw(_FLOAT), draw(_side()), draw(_side())
    target = torch.sigmoid(_t(draw, (b, c), dt, grad=False))
    weight = _t(draw, (b, c), dt, grad=False).abs() + 0.1
    pos_weight = _t(draw, (c,), dt, grad=False).abs() + 0.1
    return Args(_t(draw, (b, c), dt), target, weight, pos_weight)


@st.composite
def _classes(draw: Any) -> Args:
    """log-probabilities or logits (B, C), class indices (B,), a class weight (C,)."""
    dt, b, c = draw(_FLOAT), draw(_side()), draw(_side(2, 5))
    target = torch.tensor(draw(st.lists(st.integers(0, c - 1), min_size=b, max_size=b)))
    weight = _t(draw, (c,), dt, grad=False).abs() + 0.1
    return Args(_t(draw, (b, c), dt), target, weight)


@st.composite
def _where(draw: Any) -> Args:
    dt, shape = draw(_FLOAT), (draw(_side()), draw(_side()))
    cond = torch.tensor(draw(st.lists(st.booleans(), min_size=shape[0] * shape[1],
                                      max_size=shape[0] * shape[1]))).reshape(shape)
    return Args(cond, _t(draw, shape, dt), _t(draw, shape, dt))


@st.composite
def _masked(draw: Any) -> Args:
    dt, shape = draw(_FLOAT), (draw(_side()), draw(_side()))
    n = shape[0] * shape[1]
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(shape)
    return Args(_t(draw, shape, dt), mask, value=draw(st.sampled_from((0.0, -1.5, 2.0))))


@st.composite
def _index_add(draw: Any) -> Args:
    """x (N, D), index (K,) into N, source (K, D)."""
    dt, n, d, k = draw(_FLOAT), draw(_side()), draw(_side()), draw(_side())
    index = torch.tensor(draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k)))
    return Args(_t(draw, (n, d), dt), index, _t(draw, (k, d), dt))


@st.composite
def _gather(draw: Any) -> Args:
    """x (N, D), index (K, D) into N (repeats allowed), an unused third argument."""
    dt, n, d, k = draw(_FLOAT), draw(_side()), draw(_side()), draw(_side())
    index = torch.tensor(draw(st.lists(st.integers(0, n - 1), min_size=k * d,
                                       max_size=k * d))).reshape(k, d)
    return Args(_t(draw, (n, d), dt), index, None)


@st.composite
def _index_copy(draw: Any) -> Args:
    """x (N, D), K distinct row indices into N, source (K, D)."""
    dt, n, d = draw(_FLOAT), draw(_side()), draw(_side())
    rows = draw(st.permutations(range(n)))[:draw(st.integers(1, n))]
    return Args(_t(draw, (n, d), dt), torch.tensor(rows), _t(draw, (len(rows), d), dt))


@st.composite
def _matmul3(draw: Any, batched: bool) -> Args:
    """bias (B?, M, N), a (B?, M, K), b (B?, K, N): addmm / baddbmm."""
    dt, m, k, n = draw(_FLOAT), draw(_side()), draw(_side()), draw(_side())
    lead = (draw(_side(1, 3)),) if batched else ()
    return Args(_t(draw, lead + (m, n), dt), _t(draw, lead + (m, k), dt),
                _t(draw, lead + (k, n), dt))


@st.composite
def _square(draw: Any) -> Args:
    dt, b, n = draw(_FLOAT), draw(_side(1, 3)), draw(_side())
    return Args(_t(draw, (b, n, n), dt))


@st.composite
def _dims2(draw: Any) -> Args:
    """One 2-D+ tensor: pad, roll, flip, diag_embed, tril, triu."""
    dt = draw(_FLOAT)
    shape = tuple(draw(st.lists(_side(), min_size=2, max_size=3)))
    return Args(_t(draw, shape, dt))


@st.composite
def _clamp_bounds(draw: Any) -> Args:
    """x and tensor bounds lo <= hi of x's shape."""
    dt = draw(_FLOAT)
    shape = tuple(draw(st.lists(_side(), min_size=1, max_size=2)))
    a, b = _t(draw, shape, dt), _t(draw, shape, dt)
    lo, hi = torch.minimum(a, b).detach().requires_grad_(), torch.maximum(a, b).detach()
    return Args(_t(draw, shape, dt), lo, hi.requires_grad_())


# -- the pairs -----------------------------------------------------------------------------------

def _decomp0(op: Any) -> Callable[..., Any]:
    """The decomposition's first output (ops returning (out, saved stats...))."""
    fn = DECOMP[op]
    return lambda *a, **k: fn(*a, **k)[0]


def _elementwise() -> list[Pair]:
    ip = {"x": "out"}
    return [
        Pair("relu_", lambda x: torch.relu_(x), lambda x: RF.relu(x), ip, source="_refs"),
        Pair("abs_", lambda x: x.abs_(), lambda x: R.abs(x), ip, source="_refs"),
        Pair("sigmoid_", lambda x: x.sigmoid_(), lambda x: R.sigmoid(x), ip, source="_refs"),
        Pair("tanh_", lambda x: x.tanh_(), lambda x: R.tanh(x), ip, source="_refs"),
        Pair("exp_", lambda x: x.exp_(), lambda x: R.exp(x), ip, source="_refs"),
        Pair("silu_", lambda x: F.silu(x, inplace=True), lambda x: DECOMP[aten.silu.default](x),
             ip, source="decomp aten.silu"),
        Pair("hardtanh_", lambda x: F.hardtanh_(x), lambda x: RF.hardtanh(x), ip, source="_refs"),
        Pair("leaky_relu_", lambda x: F.leaky_relu_(x, 0.1), lambda x: RF.leaky_relu(x, 0.1), ip,
             source="_refs"),
        Pair("elu_", lambda x: F.elu_(x), lambda x: RF.elu(x), ip, source="_refs"),
        Pair("gelu", lambda x: F.gelu(x), lambda x: RF.gelu(x), source="_refs"),
        Pair("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"),
             lambda x: RF.gelu(x, approximate="tanh"), source="_refs"),
        Pair("softplus", lambda x: F.softplus(x, beta=2.0), lambda x: RF.softplus(x, beta=2.0),
             source="_refs"),
        Pair("clamp_", lambda x: x.clamp_(-0.5, 0.7), lambda x: R.clamp(x, -0.5, 0.7), ip,
             source="_refs"),
        Pair("clamp_tensor_", lambda x, lo, hi: x.clamp_(lo, hi),
             lambda x, lo, hi: R.clamp(x, lo, hi), ip, _clamp_bounds, "_refs"),
        Pair("add_", lambda x, y: x.add_(y, alpha=0.5), lambda x, y: R.add(x, y, alpha=0.5), ip,
             source="_refs"),
        Pair("mul_", lambda x, y: x.mul_(y), lambda x, y: R.mul(x, y), ip, source="_refs"),
        Pair("addcmul_", lambda x, a, b: x.addcmul_(a, b, value=0.5),
             lambda x, a, b: R.addcmul(x, a, b, value=0.5), ip, source="_refs"),
        Pair("addcdiv_", lambda x, a, b: x.addcdiv_(a, b, value=0.5),
             lambda x, a, b: R.addcdiv(x, a, b, value=0.5), ip, source="_refs"),
        Pair("lerp_", lambda x, y: x.lerp_(y, 0.3), lambda x, y: R.lerp(x, y, 0.3), ip,
             source="_refs"),
        Pair("lerp_tensor_", lambda x, y, w: x.lerp_(y, w), lambda x, y, w: R.lerp(x, y, w), ip,
             source="_refs"),
        Pair("where", lambda c, x, y: torch.where(c, x, y), lambda c, x, y: R.where(c, x, y),
             inputs=_where, source="_refs"),
        Pair("masked_fill_", lambda x, m, value: x.masked_fill_(m, value),
             lambda x, m, value: R.masked_fill(x, m, value), ip, _masked, "_refs"),
    ]


def _reductions() -> list[Pair]:
    return [
        Pair("log_softmax", lambda x: torch.log_softmax(x, -1), lambda x: R.log_softmax(x, -1),
             source="_refs"),
        Pair("softmax", lambda x: torch.softmax(x, -1), lambda x: R.softmax(x, -1),
             source="_refs"),
        Pair("logsumexp", lambda x: torch.logsumexp(x, -1), lambda x: R.logsumexp(x, -1),
             source="_refs"),
        Pair("var_correction0", lambda x: torch.var(x, -1, correction=0),
             lambda x: R.var(x, -1, correction=0), source="_refs"),
        Pair("var_correction2", lambda x: torch.var(x, correction=2),
             lambda x: R.var(x, correction=2), source="_refs"),
        Pair("std", lambda x: torch.std(x, -1), lambda x: R.std(x, -1), source="_refs"),
        Pair("cumsum", lambda x: torch.cumsum(x, -1), lambda x: R.cumsum(x, -1), source="_refs"),
        Pair("cumprod", lambda x: torch.cumprod(x, -1), lambda x: R.cumprod(x, -1),
             source="_refs"),
        Pair("vector_norm", lambda x: torch.linalg.vector_norm(x),
             lambda x: R.linalg.vector_norm(x), source="_refs"),
        Pair("vector_norm_ord3", lambda x: torch.linalg.vector_norm(x, 3, -1),
             lambda x: R.linalg.vector_norm(x, 3, -1), source="_refs"),
    ]


def _norms() -> list[Pair]:
    ln = DECOMP[aten.native_layer_norm.default]
    gn = DECOMP[aten.native_group_norm.default]
    rms = DECOMP[aten._fused_rms_norm.default]
    bn = DECOMP[aten.native_batch_norm.default]

    def gn_ref(x, w, b, groups):
        n, c = x.shape[:2]
        return gn(x, w, b, n, c, x[0, 0].numel(), groups, 1e-5)[0]

    def bn_train(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=True), rm, rv

    def bn_train_ref(x, w, b, rm, rv):  # the decomposition updates the stats it is given
        rm, rv = rm.clone(), rv.clone()
        return bn(x, w, b, rm, rv, True, 0.1, 1e-5)[0], rm, rv

    return [
        Pair("layer_norm", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
             lambda x, w, b: RF.layer_norm(x, x.shape[-1:], w, b), inputs=_rows_affine,
             source="_refs"),
        Pair("native_layer_norm", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
             lambda x, w, b: ln(x, x.shape[-1:], w, b, 1e-5)[0], inputs=_rows_affine,
             source="decomp aten.native_layer_norm"),
        Pair("group_norm", lambda x, w, b, groups: F.group_norm(x, groups, w, b),
             lambda x, w, b, groups: RF.group_norm(x, groups, w, b), inputs=_groups,
             source="_refs"),
        Pair("native_group_norm", lambda x, w, b, groups: F.group_norm(x, groups, w, b), gn_ref,
             inputs=_groups, source="decomp aten.native_group_norm"),
        Pair("rms_norm", lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, 1e-6) + b,
             lambda x, w, b: rms(x, list(x.shape[-1:]), w, 1e-6)[0] + b, inputs=_rows_affine,
             source="decomp aten._fused_rms_norm"),
        Pair("batch_norm_train", bn_train, bn_train_ref, {"rm": 1, "rv": 2}, _batch_norm,
             "decomp aten.native_batch_norm"),
        Pair("batch_norm_eval", lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b),
             lambda x, w, b, rm, rv: bn(x, w, b, rm, rv, False, 0.1, 1e-5)[0],
             inputs=_batch_norm, source="decomp aten.native_batch_norm"),
    ]


def _losses() -> list[Pair]:
    bce = DECOMP[aten.binary_cross_entropy_with_logits.default]
    nll = DECOMP[aten.nll_loss_forward.default]
    return [
        Pair("bce_with_logits", lambda x, t, w, pw: F.binary_cross_entropy_with_logits(
            x, t, w, pos_weight=pw), lambda x, t, w, pw: bce(x, t, w, pw, 1), inputs=_logits_targets,
            source="decomp aten.binary_cross_entropy_with_logits"),
        Pair("mse_loss", lambda x, y: F.mse_loss(x, y), lambda x, y: RF.mse_loss(x, y),
             source="_refs"),
        Pair("smooth_l1_loss", lambda x, y: F.smooth_l1_loss(x, y, beta=0.5),
             lambda x, y: RF.smooth_l1_loss(x, y, beta=0.5), source="_refs"),
        Pair("huber_loss", lambda x, y: F.huber_loss(x, y, delta=0.5),
             lambda x, y: RF.huber_loss(x, y, delta=0.5), source="_refs"),
        Pair("nll_loss", lambda x, t, w: F.nll_loss(x, t, w), lambda x, t, w: RF.nll_loss(x, t, w),
             inputs=_classes, source="_refs"),
        Pair("nll_loss_forward", lambda x, t, w: F.nll_loss(x, t, w),
             lambda x, t, w: nll(x, t, w, 1, -100)[0], inputs=_classes,
             source="decomp aten.nll_loss_forward"),
        Pair("cross_entropy", lambda x, t, w: F.cross_entropy(x, t, w),
             lambda x, t, w: RF.nll_loss(R.log_softmax(x, -1), t, w), inputs=_classes,
             source="_refs nll_loss(log_softmax)"),
        Pair("dropout_p0", lambda x: F.dropout(x, 0.0), lambda x: RF.dropout(x, 0.0),
             source="_refs"),
        Pair("dropout_eval", lambda x: F.dropout(x, 0.3, training=False),
             lambda x: RF.dropout(x, 0.3, training=False), source="_refs"),
    ]


def _structured() -> list[Pair]:
    ip = {"x": "out"}
    return [
        Pair("index_add_", lambda x, i, s: x.index_add_(0, i, s, alpha=2.0),
             lambda x, i, s: R.index_add(x, 0, i, s, alpha=2.0), ip, _index_add, "_refs"),
        Pair("take_along_dim", lambda x, i, s: torch.take_along_dim(x, i, 0),
             lambda x, i, s: R.take_along_dim(x, i, 0), inputs=_gather, source="_refs"),
        Pair("index_copy_", lambda x, i, s: x.index_copy_(0, i, s),
             lambda x, i, s: R.index_copy(x, 0, i, s), ip, _index_copy, "_refs"),
        Pair("addmm", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
             lambda c, a, b: DECOMP[aten.addmm.default](c, a, b, beta=0.5, alpha=2.0),
             inputs=lambda: _matmul3(False), source="decomp aten.addmm"),
        Pair("baddbmm", lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
             lambda c, a, b: DECOMP[aten.baddbmm.default](c, a, b, beta=0.5, alpha=2.0),
             inputs=lambda: _matmul3(True), source="decomp aten.baddbmm"),
        Pair("pad", lambda x: F.pad(x, (1, 2, 0, 1), value=0.5),
             lambda x: R.constant_pad_nd(x, (1, 2, 0, 1), 0.5), inputs=_dims2, source="_refs"),
        Pair("roll", lambda x: torch.roll(x, (1, -2), (0, -1)),
             lambda x: R.roll(x, (1, -2), (0, -1)), inputs=_dims2, source="_refs"),
        Pair("flip", lambda x: torch.flip(x, (0, -1)), lambda x: R.flip(x, (0, -1)),
             inputs=_dims2, source="_refs"),
        Pair("diag_embed", lambda x: torch.diag_embed(x, 1), lambda x: R.diag_embed(x, 1),
             inputs=_dims2, source="_refs"),
        Pair("tril_", lambda x: x.tril_(-1), lambda x: R.tril(x, -1), ip, _square, "_refs"),
        Pair("triu_", lambda x: x.triu_(1), lambda x: R.triu(x, 1), ip, _square, "_refs"),
    ]


def pairs() -> list[Pair]:
    return _elementwise() + _reductions() + _norms() + _losses() + _structured()


# -- running -------------------------------------------------------------------------------------

_SPECS: dict[str, Any] = {}


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    return fn


def spec_for(pair: Pair) -> Any:
    """The registered implementation of a pair (registered once per process)."""
    if pair.label not in _SPECS:
        impl = _named(pair.impl, f"aten_{pair.label}")
        ref = _named(pair.ref, f"ref_{pair.label}")
        _SPECS[pair.label] = equivalent_to(
            ref, mutates=pair.mutates, name=f"realcode.{pair.label}",
            inputs=pair.inputs() if pair.inputs is not None else None)(impl)
    return _SPECS[pair.label]


def run_pair(pair: Pair, examples: int, modes: tuple[str, ...], seed: int) -> dict:
    """One row: status, the findings' (check, headline), wall time."""
    start = time.perf_counter()
    row: dict[str, Any] = {"pair": pair.label, "reference": pair.source}
    try:
        cfg = equiv.settings(max_examples=examples, seed=seed, modes=modes,
                             hypothesis_settings=hypothesis.settings(database=None))
        report = equiv.check(spec_for(pair), settings=cfg, raise_on_failure=False)
        row["findings"] = [{"check": f.check, "mode": f.mode, "headline": f.headline,
                            "message": f.message} for f in report.findings]
        row["status"] = "pass" if report.ok else "FAIL"
        row["examples"] = report.examples_run
    except Exception as exc:  # noqa: BLE001  (a usage or internal error is the row's verdict)
        row["status"], row["findings"] = "ERROR", []
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    if row["status"] != "pass":
        row["known"] = classify(pair.label, row["findings"])
    return row


def classify(label: str, findings: list[dict]) -> str:
    """``real``, ``false alarm``, ``real + false alarm``, or ``unclassified`` when a finding's
    check is in neither table (or the row is an ERROR)."""
    kinds = set()
    for f in findings:
        if f["check"] in KNOWN_REAL.get(label, {}):
            kinds.add("real")
        elif f["check"] in FALSE_ALARMS.get(label, {}):
            kinds.add("false alarm")
        else:
            return "unclassified"
    return " + ".join(sorted(kinds, reverse=True)) or "unclassified"


def _line(row: dict) -> str:
    if row["status"] == "pass":
        what = ""
    elif row["status"] == "ERROR":
        what = row["error"]
    else:
        what = "; ".join(f"{f['check']}[{f['mode']}]: {f['headline']}" for f in row["findings"])
    tag = "" if row["status"] == "pass" else f" ({row['known']})"
    return f"| {row['pair']} | {row['reference']} | {row['status']}{tag} | {what} | " \
           f"{row['seconds']} |"


def bench(examples: int = 30, modes: tuple[str, ...] = ("eager",), only: tuple[str, ...] = (),
          seed: int = 0, json_path: str | None = None) -> str:
    chosen = [p for p in pairs() if not only or p.label in only]
    warnings.filterwarnings("ignore", category=UserWarning)  # mse_loss's broadcasting warning
    rows = []
    print("| pair | reference | verdict | findings | s |\n| --- | --- | --- | --- | ---: |",
          flush=True)
    for pair in chosen:
        rows.append(run_pair(pair, examples, modes, seed))
        print(_line(rows[-1]), flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "FAIL", "ERROR")}
    new = [r["pair"] for r in rows if r.get("known") == "unclassified"]
    false = [r["pair"] for r in rows if "false alarm" in r.get("known", "")]
    summary = (f"{len(rows)} pairs, {examples} examples, modes {','.join(modes)}: "
               f"{counts['pass']} pass, {counts['FAIL']} FAIL, {counts['ERROR']} ERROR; "
               f"known false alarms still reported: {', '.join(false) or 'none'}; "
               f"unclassified non-passes: {', '.join(new) or 'none'}")
    print(summary)
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows, "counts": counts}, indent=1))
    table = ["| pair | reference | verdict | findings | s |", "| --- | --- | --- | --- | ---: |"]
    return "\n".join(table + [_line(r) for r in rows] + ["", summary])


QUICK = ("relu_", "layer_norm", "mse_loss")


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=30, help="examples per pair (default 30)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, 4 examples")
    p.add_argument("--modes", default="eager",
                   help="comma-separated: eager, compile (= compile[aot_eager]), ...")
    p.add_argument("--only", default="", metavar="P1,P2", help="only these pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    modes = tuple("compile[aot_eager]" if m == "compile" else m for m in a.modes.split(","))
    only = QUICK if a.quick else tuple(x for x in a.only.split(",") if x)
    return bench(4 if a.quick else a.examples, modes, only, a.seed, a.json)


if __name__ == "__main__":
    main()
