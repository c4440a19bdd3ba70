"""Baseline-relative numerics: judge an implementation by the error its reference makes.

Three runs of the same example: the implementation, the *oracle* (the reference in float64, or
complex128; float32 where the device has no float64) and the *baseline* (the reference at the
implementation's dtype and device). A floating result passes when, at every element,

    |actual - oracle|  <=  k * E_b  +  floor

where ``E_b = max |baseline - oracle|`` over the tensor and ``floor`` is the larger of
``floor_ulps`` ULPs of the dtype at ``max |oracle|`` and torch.testing's per-dtype tolerance
(``atol + rtol * |oracle|``), so the rule never rejects what the default tolerance accepts.
Where no oracle can be run, :func:`judge` falls back to the per-dtype default and says so.

Pure functions: nothing here runs a check or knows a spec.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping

import torch

from equiv._compat import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from equiv._explain import explaining
from equiv.compare import Mismatch, compare_leaf, dtype_tolerance
from equiv.errors import user_error

#: default k per check: outputs (and final values of mutated arguments), first-order
#: gradients, second-order gradients (double backward)
K_DEFAULTS: Mapping[str, float] = {"outputs": 2.0, "gradients": 3.0, "second-order": 4.0}
#: ULPs of the dtype, at the tensor's largest |oracle|, always allowed
FLOOR_ULPS = 2.0
#: the floor per check: a backward rounds about twice as often as its forward (and its
#: reductions over broadcast dimensions sum rounded terms), a double backward twice again
FLOOR_ULPS_DEFAULTS: Mapping[str, float] = {"outputs": FLOOR_ULPS, "gradients": 4.0,
                                            "second-order": 8.0}
#: an error within this many times (baseline error + ULP floor) is rounding, not a wrong value
ROUNDING_FACTOR = 10.0
#: tensors with at least this many elements get a p99 ULP figure in the message
P99_MIN_ELEMENTS = 100

_SHORT = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
          torch.float64: "float64", torch.complex64: "complex64", torch.complex128: "complex128"}


# -- dtypes, ULPs and rounding -------------------------------------------------------------
def oracle_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The oracle's dtype for a result of ``dtype``: float64 (complex128 for complex), float32
    (complex64) on MPS, which has no float64. Non-floating dtypes are returned unchanged."""
    no_f64 = torch.device(device).type == "mps"
    if dtype.is_complex:
        return torch.complex64 if no_f64 else torch.complex128
    if dtype.is_floating_point:
        return torch.float32 if no_f64 else torch.float64
    return dtype


def _real(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex32: torch.float16, torch.complex64: torch.float32,
            torch.complex128: torch.float64}.get(dtype, dtype)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s numbers at each ``|x|`` (float64): ``eps * 2**(e-1)`` for
    ``|x|`` in ``[2**(e-1), 2**e)``, the subnormal spacing below the smallest normal."""
    fi = torch.finfo(_real(dtype))
    a = x.detach().abs().to(torch.float64)
    spacing = torch.frexp(a)[1].sub_(1).to(torch.float64).exp2_().mul_(fi.eps)
    return spacing.masked_fill_(a < fi.tiny, fi.tiny * fi.eps)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded once, to nearest (ties to even), to ``dtype``.

    ``Tensor.to(float16/bfloat16)`` from float64 rounds twice (through float32), so
    ``1 + 2**-11 + 2**-40`` becomes 1.0 instead of ``1 + 2**-10``; this rounds in float64 at the
    target's spacing, so both sides of a comparison get the same, correctly rounded values."""
    if x.is_complex():
        real = _real(dtype) if dtype.is_complex else dtype
        out = torch.complex(round_to(x.real, real), round_to(x.imag, real))
        return out.to(dtype) if dtype.is_complex else out.real
    if dtype not in (torch.float16, torch.bfloat16) or not x.dtype.is_floating_point:
        return x.to(dtype)
    x64 = x.detach().to(torch.float64)
    s = ulp(x64, dtype)
    y = torch.round(x64 / s) * s  # torch.round: half to even
    y = torch.where(y.abs() > torch.finfo(dtype).max, y.sign() * math.inf, y)
    return torch.where(torch.isfinite(x64), y, x64).to(dtype)


def cast_args(tree: Any, dtype: torch.dtype | None) -> Any:
    """Every floating (complex) tensor of ``tree`` rounded once to ``dtype`` (the matching
    complex dtype for complex tensors); other leaves unchanged. ``None``: unchanged."""
    if dtype is None:
        return tree
    flat, spec = tree_flatten(tree)
    out = []
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            v = round_to(v, dtype)
        elif isinstance(v, torch.Tensor) and v.is_complex():
            v = round_to(v, {torch.float16: torch.complex32, torch.float32: torch.complex64,
                             torch.float64: torch.complex128}.get(dtype, v.dtype))
        out.append(v)
    return tree_unflatten(out, spec)


def upcast(tree: Any, device: torch.device | str | None = None) -> Any:
    """Every floating tensor of ``tree`` converted exactly to its oracle dtype (float64,
    complex128) on ``device`` (default: where it is), keeping autograd; others unchanged."""
    flat, spec = tree_flatten(tree)
    out = []
    for v in flat:
        if isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.is_complex()):
            dev = v.device if device is None else torch.device(device)
            v = v.to(device=dev, dtype=oracle_dtype(v.dtype, dev))
        out.append(v)
    return tree_unflatten(out, spec)


# -- the two reference runs ----------------------------------------------------------------
@dataclasses.dataclass
class ReferenceRuns:
    """The reference's result on the oracle's and on the baseline's arguments, or what it
    raised. ``oracle_error`` set: no oracle (the verdict falls back to the dtype default)."""

    oracle: Any = None
    oracle_error: BaseException | None = None
    baseline: Any = None
    baseline_error: BaseException | None = None


def _call(ref: Callable[..., Any], args: Any) -> tuple[Any, BaseException | None]:
    try:
        with torch.enable_grad():
            if hasattr(args, "call"):  # an instantiated side: Side.call(fn)
                return args.call(ref), None
            if isinstance(args, dict):
                return ref(**args), None
            return ref(*args), None
    except BaseException as e:  # the reference raised (e.g. float64 unsupported): evidence
        if not user_error(e):
            raise
        return None, e


def run_reference(ref: Callable[..., Any], oracle_args: Any,
                  baseline_args: Any = None) -> ReferenceRuns:
    """Call ``ref`` on already-instantiated arguments: ``oracle_args`` in the oracle dtype
    (see :func:`upcast`), ``baseline_args`` at the implementation's dtype/device (``None``: the
    engine already has the baseline). Each is a tuple of positional arguments, a dict of
    keyword arguments, or an object with ``.call(fn)``."""
    runs = ReferenceRuns()
    runs.oracle, runs.oracle_error = _call(ref, oracle_args)
    if baseline_args is not None:
        runs.baseline, runs.baseline_error = _call(ref, baseline_args)
    return runs


# -- the verdict ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NumericMismatch(Mismatch):
    """A floating leaf the rule rejects, with both errors as data.

    ``rule``: ``"baseline"`` (k x the baseline's error + floor) or ``"dtype-default"``
    (torch.testing's per-dtype tolerance: no oracle could be run). Errors are max abs over the
    tensor, in float64; ``allowed`` is the allowance at the worst element ``index``."""

    rule: str = "baseline"
    dtype: str = ""
    impl_error: float = math.nan
    baseline_error: float | None = None
    allowed: float = math.nan
    k: float | None = None
    floor: float | None = None
    floor_ulps: float | None = None
    floor_at: float | None = None  # the floor at the worst element (ULPs or dtype default)
    ulp_max: float | None = None
    baseline_ulp_max: float | None = None
    ulp_p99: float | None = None
    elements: int = 0
    mismatched: int = 0
    why: str | None = None  # why the fallback rule was used
    #: elements where the baseline is inf or NaN and the oracle finite (left out of its error)
    baseline_overflow: int = 0
    #: the rounding spread of the reference's intermediates at the worst element, when given
    spread: float | None = None
    #: the implementation's value at the worst element when it is not finite ("NaN", "inf")
    worst_nonfinite: str | None = None
    #: mismatched elements where the oracle is exactly 0 (no ULP distance there), and the
    #: worst ULP distance over the elements where it is not
    zero_oracle_mismatched: int = 0
    ulp_max_nonzero: float | None = None

    @property
    def rounding_level(self) -> bool:
        """True when the divergence is within ``ROUNDING_FACTOR`` x (baseline error + ULP floor)
        and its worst ULP distance within ``ROUNDING_FACTOR`` x the baseline's (or the floor's):
        a precision difference, never evidence of a stale saved value or a wrong schedule."""
        if self.rule != "baseline" or self.baseline_error is None or self.floor is None:
            return False
        ulps = max(self.baseline_ulp_max or 0.0, self.floor_ulps or 0.0)
        return (self.impl_error <= ROUNDING_FACTOR * (self.baseline_error + self.floor)
                and (self.ulp_max or 0.0) <= ROUNDING_FACTOR * ulps)


def _to64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu")
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def _same_nonfinite(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    if a.is_complex():
        return _same_nonfinite(a.real, e.real) & _same_nonfinite(a.imag, e.imag)
    return (torch.isnan(a) & torch.isnan(e)) | (a == e)


def _errors(actual: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor | None,
            baseline_nonfinite: bool = True) -> tuple[torch.Tensor, float | None]:
    """(|actual - oracle| per element, max |baseline - oracle|). Non-finite elements: 0 where
    the implementation's value equals the oracle's or the baseline's (NaN equal to NaN), inf
    otherwise; the baseline's own non-finite elements are left out of its error."""
    a, o = _to64(actual), _to64(oracle)
    diff = (a - o).abs()  # finite exactly where both are
    b = None if baseline is None else _to64(baseline)
    b_err = None if b is None else (b - o).abs()
    if bool(torch.isfinite(diff).all()) and (b_err is None or bool(torch.isfinite(b_err).all())):
        return diff, None if b_err is None else (float(b_err.max()) if b_err.numel() else 0.0)
    fin = torch.isfinite(diff)
    diff = torch.where(fin, diff, torch.zeros((), dtype=torch.float64))
    ok = _same_nonfinite(a, o)
    if b is None:
        return torch.where(fin | ok, diff, math.inf), None
    if baseline_nonfinite:
        ok = ok | _same_nonfinite(a, b)
    diff = torch.where(fin | ok, diff, math.inf)
    assert b_err is not None
    b_err = torch.where(torch.isfinite(b_err), b_err, torch.zeros((), dtype=torch.float64))
    return diff, float(b_err.max()) if b_err.numel() else 0.0


#: elements per chunk of the verdict's elementwise passes: each float64 temporary is 2 MiB,
#: so judging a large tensor holds a few chunks, not a few copies of the tensor
CHUNK = 1 << 18


@dataclasses.dataclass
class _Operands:
    """The tensors one verdict reads, flattened (a view, or one copy of a non-contiguous
    tensor at its own dtype), read in chunks converted to float64 one at a time."""

    actual: torch.Tensor
    oracle: torch.Tensor
    baseline: torch.Tensor | None
    magnitude: torch.Tensor | None
    rounding: torch.Tensor | None

    @classmethod
    def of(cls, *tensors: torch.Tensor | None) -> "_Operands":
        return cls(*(None if t is None else t.detach().reshape(-1) for t in tensors))

    def chunks(self) -> Iterable[tuple[int, list[torch.Tensor | None]]]:
        """(first element, [actual, oracle, baseline, magnitude, rounding] of the chunk)."""
        n = self.actual.numel()
        every = (self.actual, self.oracle, self.baseline, self.magnitude, self.rounding)
        for i in range(0, n, CHUNK):
            yield i, [None if t is None else _to64(t[i:i + CHUNK]) for t in every]


def _baseline_scalars(ops: _Operands, dtype: torch.dtype,
                      ulps: bool) -> tuple[float | None, float]:
    """(the baseline's error ``max |baseline - oracle|`` over its finite elements, and when
    ``ulps`` its worst distance in ULPs of ``dtype`` at ``|oracle|``, both finite)."""
    if ops.baseline is None:
        return None, 0.0
    e_b, b_ulps = 0.0, 0.0
    for _, (_, o, b, _, _) in ops.chunks():
        err = (b - o).abs()
        e_b = max(e_b, float(torch.nan_to_num(err, nan=0.0, posinf=0.0).max()))
        if ulps:
            o_abs = torch.nan_to_num(o.abs(), posinf=0.0)
            d = _errors(b, o, None)[0].div_(ulp(o_abs, dtype))
            b_ulps = max(b_ulps, float(torch.nan_to_num(d, nan=0.0, posinf=0.0).max()))
    return e_b, b_ulps


@dataclasses.dataclass
class _Verdict:
    """What the verdict's pass over the chunks found: the mismatched elements, the worst one
    (its flat index, excess over and allowance there) and the greatest difference."""

    mismatched: int = 0
    flat: int = -1
    excess: float = -math.inf
    allowed: float = math.nan
    max_diff: float = 0.0
    #: the baseline's worst ULP distance (the allowance's scale where the dtype default is
    #: not part of the floor)
    b_ulps: float = 0.0


def _verdict(ops: _Operands, *, k: float, floor_ulps: float, dtype: torch.dtype,
             baseline_nonfinite: bool, default_floor: bool,
             stop_at_first: bool = False) -> tuple[_Verdict, float | None]:
    """One pass over the chunks: ``|actual - oracle|`` against the allowance per element (see
    :func:`judge`), and the baseline's error. ``stop_at_first``: return at the first chunk
    that holds a mismatch (only whether there is one is asked)."""
    e_b, b_ulps = _baseline_scalars(ops, dtype, ulps=not default_floor)
    v = _Verdict(b_ulps=b_ulps)
    for i, (a, o, b, m, r) in ops.chunks():
        diff = _errors(a, o, b, baseline_nonfinite)[0]
        allowed = _allowed(o, m, r, b, e_b, k=k, floor_ulps=floor_ulps, dtype=dtype,
                           default_floor=default_floor, b_ulps=b_ulps)
        bad = int((diff > allowed).sum())
        v.max_diff = max(v.max_diff, float(diff.max()))
        if not bad:
            continue
        v.mismatched += bad
        if stop_at_first:
            return v, e_b
        excess = diff - allowed
        j = int(excess.argmax())
        if float(excess[j]) > v.excess:
            v.flat, v.excess, v.allowed = i + j, float(excess[j]), float(allowed[j])
    return v, e_b


def _allowed(o: torch.Tensor, m: torch.Tensor | None, r: torch.Tensor | None,
             b: torch.Tensor | None, e_b: float | None, *, k: float, floor_ulps: float,
             dtype: torch.dtype, default_floor: bool, b_ulps: float,
             **_: Any) -> torch.Tensor:
    """The allowance of one chunk: the floor (:func:`_floors`) plus ``k`` x the baseline's
    error ``e_b``, or where the dtype default is not part of the floor, ``k`` x the baseline's
    worst ULP distance ``b_ulps`` in ULPs at each element (wide ranges)."""
    _, allowed = _floors(o, m, r, floor_ulps=floor_ulps, dtype=dtype,
                         default_floor=default_floor)
    if default_floor or b is None:
        return allowed.add_(k * (e_b or 0.0))
    scale = torch.nan_to_num(o.abs(), posinf=0.0)
    scale = scale if m is None else torch.maximum(scale, m)
    return allowed.add_(ulp(scale, dtype).mul_(k * b_ulps))


@dataclasses.dataclass
class _Numbers:
    """The ULP figures of a mismatch, over the chunks: the implementation's worst ULP distance
    (and its 99th percentile), the baseline's, the baseline's overflows, and at exact zeros of
    the oracle: the mismatched elements there and the worst ULP distance elsewhere."""

    ulp_max: float = 0.0
    ulp_p99: float | None = None
    baseline_ulp_max: float | None = None
    overflow: int = 0
    zero_bad: int = 0
    ulp_max_nonzero: float | None = None


def _numbers(ops: _Operands, *, full: bool, e_b: float | None,
             **verdict: Any) -> _Numbers:
    """The ULP figures of a mismatch (:class:`_Numbers`); the percentile, the overflows and
    the zeros of the oracle only when ``full`` (a failure that is reported). ``verdict``:
    :func:`_verdict`'s options and the baseline's ``b_ulps``."""
    n, dtype = ops.actual.numel(), verdict["dtype"]
    out = _Numbers(baseline_ulp_max=None if ops.baseline is None else 0.0)
    p99 = full and P99_MIN_ELEMENTS <= n <= 16_000_000
    keep = n - int(0.99 * (n - 1))  # the largest values the percentile reads
    top = torch.empty(0, dtype=torch.float64)
    for _, (a, o, b, m, r) in ops.chunks():
        diff = _errors(a, o, b, verdict["baseline_nonfinite"])[0]
        spacing = ulp(o, dtype)  # one chunk's ULPs, read by both distances
        d = _ulp_distances(diff, o, dtype, spacing)
        out.ulp_max = max(out.ulp_max, float(d.max()))
        if p99:
            both = torch.cat([top, d])
            top = torch.topk(both, min(keep, both.numel())).values
        if b is not None:
            d_b = _ulp_distances(_errors(b, o, None)[0], o, dtype, spacing)
            out.baseline_ulp_max = max(out.baseline_ulp_max or 0.0, float(d_b.max()))
            if full:
                out.overflow += int((~torch.isfinite(b) & torch.isfinite(o)).sum())
        if full:
            _zeros(out, diff, d, o, _allowed(o, m, r, b, e_b, **verdict))
    if p99:
        out.ulp_p99 = _quantile_of_top(top, n, 0.99)
    return out


def _zeros(out: _Numbers, diff: torch.Tensor, d: torch.Tensor, o: torch.Tensor,
           allowed: torch.Tensor) -> None:
    """Add one chunk's mismatched elements at exact zeros of the oracle, and its worst ULP
    distance elsewhere, to ``out``."""
    zero = o == 0
    out.zero_bad += int(((diff > allowed) & zero).sum())
    rest = d[~zero]
    if rest.numel():
        out.ulp_max_nonzero = max(out.ulp_max_nonzero or 0.0, float(rest.max()))


def _ulp_distances(diff: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype,
                   spacing: torch.Tensor | None = None) -> torch.Tensor:
    """``diff`` in ULPs of ``dtype`` at ``|oracle|`` (NaN and inf: inf), 1-d; ``spacing``:
    ``ulp(oracle, dtype)`` when already known."""
    d = (diff / (ulp(oracle, dtype) if spacing is None else spacing)).reshape(-1)
    return torch.nan_to_num_(d, nan=math.inf, posinf=math.inf)


def _quantile_of_top(top: torch.Tensor, n: int, q: float) -> float:
    """``torch.quantile`` (linear interpolation) at ``q`` of ``n`` values of which ``top``
    holds the largest ``n - int(q * (n - 1))``, in descending order."""
    rank = torch.tensor(q, dtype=torch.float64) * (n - 1)
    below, above = int(rank), int(torch.ceil(rank))
    return float(top[-1].clone().lerp_(top[below - above - 1], rank - below))


def judge(actual: torch.Tensor, oracle: torch.Tensor | None, baseline: torch.Tensor | None, *,
          k: float = K_DEFAULTS["outputs"], floor_ulps: float = FLOOR_ULPS,
          dtype: torch.dtype | None = None, path: str = "", why: str | None = None,
          baseline_nonfinite: bool = True, magnitude: torch.Tensor | None = None,
          rounding: torch.Tensor | None = None,
          default_floor: bool = True) -> NumericMismatch | None:
    """Judge one floating tensor. ``oracle`` None: fall back to the per-dtype default
    tolerance against ``baseline`` (``why`` says why, for the message). ``dtype``: the
    implementation's (default ``actual.dtype``); shapes must agree (compare structure first).
    ``baseline_nonfinite=False``: an inf/NaN the baseline shares is still an error (the
    caller asked for the float64 answer, e.g. ``reference_dtype=torch.float64``).
    ``magnitude``: per element, the size of the terms the value sums (``sum |term|``; the ULP
    floor is taken there when it exceeds ``|oracle|``: cancellation keeps the terms' rounding).
    ``rounding``: per element, how far rounding the reference's intermediates moves the value
    (absolute, e.g. :func:`equiv.execution.rounding.rounding_spread`); ``floor_ulps`` times it
    is part of the floor. ``default_floor=False``: the per-dtype default tolerance is not part of
    the floor (float16/bfloat16 outputs: the ULPs and the baseline decide). Large tensors are
    judged in chunks of :data:`CHUNK` elements: a few float64 chunks are held, not copies."""
    dtype = dtype or actual.dtype
    if oracle is None:
        return _fallback(actual, baseline, dtype=dtype, path=path, why=why)
    if actual.shape != oracle.shape or (baseline is not None and baseline.shape != oracle.shape):
        raise ValueError(f"judge({path!r}): shapes differ: {tuple(actual.shape)} vs "
                         f"{tuple(oracle.shape)}; compare structure before judging numerics")
    if actual.numel() == 0:
        return None
    ops = _Operands.of(actual, oracle, baseline, magnitude, rounding)
    options = dict(k=k, floor_ulps=floor_ulps, dtype=dtype,
                   baseline_nonfinite=baseline_nonfinite, default_floor=default_floor)
    v, e_b = _verdict(ops, **options)
    if not v.mismatched:
        return None
    flat = v.flat
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape)) \
        if actual.dim() else ()
    ulp_floor, floor_at = _floors_at(flat, ops.oracle, ops.magnitude, ops.rounding,
                                     floor_ulps=floor_ulps, dtype=dtype,
                                     default_floor=default_floor)
    full = explaining()  # the numbers only a reported failure shows
    got = _numbers(ops, full=full, e_b=e_b, b_ulps=v.b_ulps, **options)
    m = NumericMismatch(
        path=path, message="", max_abs=v.max_diff, max_rel=None, index=index,
        rule="baseline", dtype=_SHORT.get(dtype, str(dtype)), impl_error=v.max_diff,
        baseline_error=e_b, k=k, floor_ulps=floor_ulps, ulp_max=got.ulp_max,
        baseline_ulp_max=got.baseline_ulp_max, ulp_p99=got.ulp_p99, elements=actual.numel(),
        mismatched=v.mismatched, baseline_overflow=got.overflow,
        worst_nonfinite=_nonfinite(_to64(ops.actual[flat])),
        allowed=v.allowed, floor=ulp_floor, floor_at=floor_at,
        spread=None if rounding is None else float(_to64(ops.rounding[flat])),
        **(_zero_oracle(got) if full else {}))
    return dataclasses.replace(m, message=describe(m))


def rejects(actual: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor | None, *,
            k: float = K_DEFAULTS["outputs"], floor_ulps: float = FLOOR_ULPS,
            dtype: torch.dtype | None = None, baseline_nonfinite: bool = True,
            magnitude: torch.Tensor | None = None, rounding: torch.Tensor | None = None,
            default_floor: bool = True, **_: Any) -> bool:
    """Whether :func:`judge` (with an oracle) rejects ``actual``, without the numbers of the
    mismatch."""
    if actual.numel() == 0:
        return False
    v, _e = _verdict(_Operands.of(actual, oracle, baseline, magnitude, rounding), k=k,
                     floor_ulps=floor_ulps, dtype=dtype or actual.dtype,
                     baseline_nonfinite=baseline_nonfinite, default_floor=default_floor,
                     stop_at_first=True)
    return v.mismatched > 0


def _floors(oracle: torch.Tensor, magnitude: torch.Tensor | None,
            rounding: torch.Tensor | None, *, floor_ulps: float, dtype: torch.dtype,
            default_floor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ULP floor, the floor) per element: ``floor_ulps`` ULPs of the larger of
    ``|oracle|`` and ``magnitude`` (at least ``floor_ulps`` x the rounding spread), and that or
    the per-dtype default on ``|oracle|`` when ``default_floor``. Computed in place: three
    float64 temporaries at most."""
    o_abs = torch.nan_to_num(_to64(oracle).abs(), posinf=0.0)
    scale = o_abs if magnitude is None else torch.maximum(o_abs, _to64(magnitude).reshape(
        o_abs.shape))
    ulp_floor = ulp(scale, dtype).mul_(floor_ulps)
    del scale
    if rounding is not None:
        torch.maximum(ulp_floor, _to64(rounding).reshape(o_abs.shape) * floor_ulps,
                      out=ulp_floor)
    rtol, atol = dtype_tolerance(dtype) if default_floor else (0.0, 0.0)
    floor = o_abs.mul_(rtol).add_(atol)
    return ulp_floor, torch.maximum(floor, ulp_floor, out=floor)


def _floors_at(flat: int, oracle: torch.Tensor, magnitude: torch.Tensor | None,
               rounding: torch.Tensor | None, **options: Any) -> tuple[float, float]:
    """:func:`_floors` at one element (row-major index ``flat``)."""
    def one(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(-1)[flat:flat + 1]
    ulp_floor, floor = _floors(one(oracle), one(magnitude), one(rounding), **options)
    return float(ulp_floor), float(floor)


def _nonfinite(v: torch.Tensor) -> str | None:
    """"NaN", "inf" or "-inf" for a non-finite scalar (complex: its worst part), else None."""
    if bool(torch.isfinite(v)):
        return None
    parts = [v.real, v.imag] if v.is_complex() else [v]
    if any(bool(torch.isnan(p)) for p in parts):
        return "NaN"
    return "-inf" if any(float(p) < 0 for p in parts if bool(torch.isinf(p))) else "inf"


def _zero_oracle(got: _Numbers) -> dict[str, Any]:
    """The mismatched elements at an exact 0 of the oracle (where a ULP distance means
    nothing), and the worst ULP distance elsewhere."""
    if not got.zero_bad:
        return {}
    return {"zero_oracle_mismatched": got.zero_bad, "ulp_max_nonzero": got.ulp_max_nonzero}


def _fallback(actual: torch.Tensor, baseline: torch.Tensor | None, *, dtype: torch.dtype,
              path: str, why: str | None) -> NumericMismatch | None:
    if baseline is None:
        raise ValueError(f"judge({path!r}): give an oracle or a baseline")
    m = compare_leaf(actual, baseline, rtol=None, atol=None, path=path)
    if m is None:
        return None
    rtol, atol = dtype_tolerance(dtype)
    why = why or "no oracle"
    return NumericMismatch(
        path=path, message=f"{m.message}\n(per-dtype default rtol={rtol:g}, atol={atol:g}: "
                           f"{why})",
        max_abs=m.max_abs, max_rel=m.max_rel, index=m.index, rule="dtype-default",
        dtype=_SHORT.get(dtype, str(dtype)), impl_error=m.max_abs if m.max_abs is not None
        else math.nan, elements=actual.numel(), why=why)


def describe(m: NumericMismatch) -> str:
    """The message lines of a baseline-rule mismatch (both errors, the allowance, ULPs)."""
    at = f" at index {m.index}" if m.index is not None else ""
    floor = (f"{m.floor_ulps:.3g} ulp" if m.floor_at is None or m.floor is None
             or m.floor_at <= m.floor else f"the {m.dtype} default tolerance {m.floor_at:.2g}")
    if m.spread is not None and m.floor is not None and m.floor_ulps and \
            m.floor <= m.floor_ulps * m.spread and (m.floor_at or 0.0) <= m.floor:
        floor = (f"{m.floor_ulps:.3g}x the rounding spread of the reference's intermediates "
                 f"{m.spread:.2g}")
    error = (f"{m.impl_error:.3g}" if m.worst_nonfinite is None else
             f"{m.worst_nonfinite} (the implementation's value is {m.worst_nonfinite})")
    lines = [
        f"implementation max error {error} vs {oracle_name(m.dtype)}, "
        f"{_own_error(m)}, allowed {m.k:g}x + {floor} = {m.allowed:.3g}{at}",
        f"Mismatched elements: {m.mismatched} / {m.elements} "
        f"({100.0 * m.mismatched / max(m.elements, 1):.1f}%)",
        _ulp_line(m),
    ]
    if m.baseline_error is not None and m.floor is not None and m.rounding_level:
        lines.append(_rounding_line(m))
    return "\n".join(lines)


def _ulp_line(m: NumericMismatch) -> str:
    """The ULP distance, only where it means something: none to a non-finite value, none
    at an exact 0 of the oracle (the spacing there is the smallest subnormal's)."""
    head = f"ULP distance from {oracle_name(m.dtype)} (in {m.dtype} ulps): "
    if m.worst_nonfinite is not None:
        return head + f"none at the worst element (the implementation's value is " \
            f"{m.worst_nonfinite})"
    if m.zero_oracle_mismatched:
        elsewhere = (f"max {m.ulp_max_nonzero:.3g} where {oracle_name(m.dtype)} is nonzero; "
                     if m.ulp_max_nonzero is not None else "")
        return head + elsewhere + (f"none at the {m.zero_oracle_mismatched} mismatched "
                                   f"element(s) where {oracle_name(m.dtype)} is exactly 0 (the "
                                   "error there is absolute)")
    return head + f"max {m.ulp_max:.3g}" + (f", p99 {m.ulp_p99:.3g}" if m.ulp_p99 is not None
                                            else "")


def _own_error(m: NumericMismatch) -> str:
    """The baseline's error, or where it has none: inf/NaN where the oracle is finite."""
    n = m.baseline_overflow
    if n and n >= m.elements:
        return f"the {m.dtype} reference has no finite error (inf/NaN at all {n} elements)"
    where = f" (inf/NaN at {n} of {m.elements} elements, left out)" if n else ""
    return f"the {m.dtype} reference's own error {m.baseline_error:.3g}{where}"


def _rounding_line(m: NumericMismatch) -> str:
    """Why ``m`` is rounding-level (:attr:`NumericMismatch.rounding_level`), with its numbers;
    in half precision, why it is still reported."""
    assert m.baseline_error is not None and m.floor is not None
    floor = f"the {m.floor_ulps or 0.0:.3g}-ulp floor {m.floor:.3g}"
    size = f"(the reference's own error {m.baseline_error:.3g} + {floor})" \
        if m.baseline_error else floor
    b_ulps, f_ulps = m.baseline_ulp_max or 0.0, m.floor_ulps or 0.0
    ulps = (f"the reference's {b_ulps:.3g}" if b_ulps > f_ulps else f"the floor's {f_ulps:.3g}")
    line = (f"rounding-level: error {m.impl_error:.3g} within {ROUNDING_FACTOR:g}x {size} = "
            f"{ROUNDING_FACTOR * (m.baseline_error + m.floor):.3g}, and {m.ulp_max or 0.0:.3g} "
            f"ulps within {ROUNDING_FACTOR:g}x {ulps} ulps")
    if m.dtype not in ("float16", "bfloat16"):
        return line
    return (f"{line}; in {m.dtype} a precision bug (accumulating or rounding intermediates in "
            f"{m.dtype}) looks like this, so it is reported (settings(tolerances=...) accepts it "
            "where intended)")


#: the oracle is not valid for a value when the reference at the value's dtype and in float64
#: differ by more than this share of the values' size (or ``ORACLE_INVALID_ULPS`` ULPs of it,
#: if larger): no rounding does that; a reference drawing random numbers in its compute dtype
#: (a dropout mask) does, and so does one that is another function in float64
ORACLE_INVALID_SHARE = 0.05
ORACLE_INVALID_ULPS = 64.0


def oracle_disagreement(oracle: torch.Tensor, baseline: torch.Tensor, dtype: torch.dtype,
                        magnitude: torch.Tensor | None = None,
                        example_size: float | None = None) -> tuple[float, float] | None:
    """``(max |baseline - oracle|, size)`` when the reference at ``dtype`` (the baseline) and in
    float64 (the oracle) differ far beyond ``dtype``'s rounding of the values (the larger of
    ``ORACLE_INVALID_SHARE`` x and ``ORACLE_INVALID_ULPS`` ULPs of ``size``, the largest finite
    ``|oracle|``, ``|baseline|``, ``magnitude`` of their terms, or ``example_size``: the largest
    value the example feeds the reference, the size cancellation rounds at), else None: then
    the oracle is another function for this example and cannot judge it. Elements where either
    is inf/NaN are left out."""
    if oracle.shape != baseline.shape or oracle.numel() == 0:
        return None
    ops = _Operands.of(baseline, oracle, None, None, None)
    zero = torch.zeros((), dtype=torch.float64)
    finite, diff, size = False, 0.0, 0.0
    for _, (b, o, _, _, _) in ops.chunks():  # in chunks: no float64 copy of either
        fin = torch.isfinite(o) & torch.isfinite(b)
        if not bool(fin.any()):
            continue
        finite = True
        diff = max(diff, float(torch.where(fin, (b - o).abs(), zero).max()))
        size = max(size, float(torch.where(fin, o.abs(), zero).max()),
                   float(torch.where(fin, b.abs(), zero).max()))
    if not finite:
        return None
    if example_size is not None and math.isfinite(example_size):
        size = max(size, example_size)
    if magnitude is not None and magnitude.numel():
        flat = magnitude.detach().reshape(-1)
        size = max(size, max(float(torch.nan_to_num(_to64(flat[i:i + CHUNK]), nan=0.0,
                                                    posinf=0.0).max())
                             for i in range(0, flat.numel(), CHUNK)))
    limit = max(ORACLE_INVALID_SHARE * size,
                ORACLE_INVALID_ULPS * float(ulp(torch.tensor(size), dtype)))
    return (diff, size) if diff > limit else None


def oracle_name(dtype: str) -> str:
    """The oracle's dtype name for a result of dtype ``dtype`` ("float32", "torch.complex64")."""
    return "complex128" if "complex" in dtype else "float64"


# -- finite differences --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FiniteDifference:
    """``<cotangent, J v>`` by central differences (``value``) against the implementation's
    ``<vjp(cotangent), v>`` (``analytic``), and the tolerance between them: ``fd_error`` (the
    difference's own error, estimated from two step sizes) + ``rounding`` (the implementation
    dtype's rounding of the gradient's terms)."""

    value: float
    analytic: float
    tolerance: float
    step: float
    skipped: tuple[str, ...] = ()  # leaves not perturbed (complex, integer)
    fd_error: float = 0.0
    rounding: float = 0.0
    #: elements of the implementation's gradient that are inf/NaN, left out of the direction
    #: because the reference's outputs are inf/NaN too; negative: that many inf/NaN where the
    #: reference's outputs are all finite (a mismatch)
    nonfinite: int = 0

    @property
    def ok(self) -> bool:
        if self.nonfinite < 0:
            return False
        if math.isnan(self.value) and math.isnan(self.analytic):
            return True  # NaN equals NaN
        return abs(self.value - self.analytic) <= self.tolerance


#: how many times the two step sizes' difference the finite difference's error is allowed: an
#: O(h^2) error is a third of it, an O(h) one (at a kink of the derivative) all of it
FD_ERROR_FACTOR = 2.0


def _is_none(x: Any) -> bool:
    return x is None


def random_direction(args: Any, seed: int = 0) -> Any:
    """A float64 direction shaped like ``args``: unit-norm Gaussian over every real floating
    tensor (one direction for all of them together), ``None`` elsewhere (integers, complex)."""
    flat, spec = tree_flatten(args, is_leaf=_is_none)
    gen = torch.Generator().manual_seed(seed)
    vs = [torch.randn(v.shape, generator=gen, dtype=torch.float64)
          if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else None for v in flat]
    return tree_unflatten(_unit(vs), spec)


def _unit(vs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    norm = math.sqrt(sum(float((v * v).sum()) for v in vs if v is not None)) or 1.0
    return [None if v is None else v / norm for v in vs]


def _as_tensors(result: Any) -> list[torch.Tensor]:
    return [torch.as_tensor(v).detach().to("cpu") for v in tree_flatten(result)[0]
            if isinstance(v, torch.Tensor) or hasattr(v, "__array__")]


def _difference(cot: list[torch.Tensor], plus: list[torch.Tensor],
                minus: list[torch.Tensor]) -> tuple[float, float, bool]:
    """(Re <c, f+ - f->, sum |c| (|f+| + |f-|) / 2 over finite values, whether any value is
    inf/NaN), in float64. An element that is the same inf or NaN at both points counts 0
    (NaN equals NaN); one that changes between them makes the difference inf/NaN."""
    total, scale, nonfinite = 0.0, 0.0, False
    for c, p, m in zip(cot, plus, minus):
        c, p, m = _to64(c), _to64(p), _to64(m)
        fin = torch.isfinite(p) & torch.isfinite(m)
        nonfinite = nonfinite or not bool(fin.all())
        d = torch.where(_same_nonfinite(p, m), torch.zeros((), dtype=p.dtype), p - m)
        total += float((c.conj() * d).real.sum())
        size = torch.where(fin, p.abs() + m.abs(), torch.zeros((), dtype=torch.float64))
        scale += float((c.abs() * size).sum()) / 2
    return total, scale, nonfinite


def fd_vjp(fn: Callable[..., Any], args: tuple, cotangent: Any, direction: Any, *,
           eps: float | None = None) -> tuple[float, float, float, bool]:
    """``<cotangent, J v>`` of ``fn`` at ``args`` along ``direction`` by central differences in
    float64 at two steps, ``h`` and ``h/2``: four calls of ``fn``. Returns (the ``h/2``
    estimate, ``h/2``, its error bound, whether an output was inf/NaN). The bound is
    ``FD_ERROR_FACTOR x`` the two estimates' difference (the truncation error: a third of it
    where the reference is smooth, all of it where its derivative has a kink along the
    direction, where central differences are O(h)), float64 rounding ``u * sum|c||f| / h`` and
    the a-priori ``h**2 * (|value| + sum|c||f|)``."""
    a_flat, a_spec = tree_flatten(args, is_leaf=_is_none)
    d_flat = direction if isinstance(direction, list) and len(direction) == len(a_flat) \
        else tree_flatten(direction, is_leaf=_is_none)[0]
    if len(d_flat) != len(a_flat):
        raise ValueError("fd_vjp: direction must be shaped like args (see random_direction)")
    scale_x = max([float(_to64(a).abs().max()) for a, d in zip(a_flat, d_flat)
                   if d is not None and a.numel()] + [1.0])
    h = eps if eps is not None else torch.finfo(torch.float64).eps ** (1 / 3) * scale_x
    cot = [c for c in tree_flatten(cotangent)[0] if isinstance(c, torch.Tensor)]

    def at(step: float) -> list[torch.Tensor]:
        moved = [a.detach().to(torch.float64) + step * d if d is not None else a
                 for a, d in zip(a_flat, d_flat)]
        with torch.no_grad():
            return _as_tensors(fn(*tree_unflatten(moved, a_spec)))

    estimates = []
    for step in (h, h / 2):
        total, scale, nonfinite = _difference(cot, at(step), at(-step))
        estimates.append((total / (2 * step), scale, nonfinite))
    (coarse, _, nf1), (value, scale, nf2) = estimates
    u = torch.finfo(torch.float64).eps
    error = (FD_ERROR_FACTOR * abs(coarse - value) + u * scale / (h / 2)
             + h * h * (abs(value) + scale))
    return value, h / 2, error, nf1 or nf2


def check_vjp_fd(fn: Callable[..., Any], args: tuple, cotangent: Any, impl_grads: Any, *,
                 dtype: torch.dtype, seed: int = 0, ulps: float = 8.0,
                 eps: float | None = None, terms: Any = None) -> FiniteDifference:
    """Compare the implementation's VJP ``impl_grads`` (shaped like ``args``, None where no
    gradient) with central differences of ``fn`` (the reference, called in float64) along one
    random direction, then along the implementation's own gradient (which no sign or scale
    error survives): eight calls of ``fn`` (two step sizes each). Returns the first failing
    comparison, else the random one. Tolerance: the difference's error estimate
    (:func:`fd_vjp`) plus ``ulps`` ULPs of ``dtype`` on ``||T * v||_2``, ``T`` the size of each
    gradient element's terms (``terms``, shaped like ``args``, e.g. an expanded argument's
    summed ``|term|``; at least ``|g|``): the implementation's rounding, independent per
    element. Elements where the implementation's gradient is inf/NaN are left out when the
    reference's outputs are inf/NaN too (NaN equals NaN), else the comparison fails. Complex
    and integer arguments are not perturbed (listed in ``skipped``)."""
    args64 = upcast(args)
    cot = [upcast(c) for c in tree_flatten(cotangent)[0]]
    g_flat = tree_flatten(impl_grads, is_leaf=_is_none)[0]
    t_flat = [None] * len(g_flat) if terms is None else tree_flatten(terms, is_leaf=_is_none)[0]
    d_rand = tree_flatten(random_direction(args64, seed), is_leaf=_is_none)[0]
    grads = [None if d is None or not isinstance(g, torch.Tensor) else
             _to64(g).reshape(d.shape) for g, d in zip(g_flat, d_rand)]
    finite = [None if g is None else torch.isfinite(g) for g in grads]
    bad = sum(int((~f).sum()) for f in finite if f is not None)
    grads = [None if g is None else torch.where(f, g, 0.0) for g, f in zip(grads, finite)]
    sizes = [None if g is None else g.abs() if t is None else torch.where(f, torch.maximum(
             g.abs(), torch.nan_to_num(_to64(t).reshape(g.shape), nan=0.0, posinf=0.0)), 0.0)
             for g, t, f in zip(grads, t_flat, finite)]
    d_rand = _unit([d if f is None else d * f for d, f in zip(d_rand, finite)])
    skipped = tuple(keystr(p) for (p, a), d in zip(
        tree_flatten_with_path(args, is_leaf=_is_none)[0], d_rand)
        if isinstance(a, torch.Tensor) and d is None)
    results, seen_nonfinite = [], False
    for d_flat in (d_rand, _unit(grads)):
        value, h, fd_err, nonfinite = fd_vjp(fn, args64, cot, d_flat, eps=eps)
        seen_nonfinite = seen_nonfinite or nonfinite
        analytic = sum(float((g * d).sum()) for g, d in zip(grads, d_flat)
                       if g is not None and d is not None)
        size = math.sqrt(sum(float(((s * d) ** 2).sum()) for s, d in zip(sizes, d_flat)
                             if s is not None and d is not None))
        rounding = ulps * torch.finfo(_real(dtype)).eps * size
        results.append(FiniteDifference(value, analytic, fd_err + rounding, h, skipped,
                                        fd_err, rounding, bad))
    if bad and not seen_nonfinite:  # inf/NaN in the gradient where the reference is finite
        results.insert(0, dataclasses.replace(results[0], analytic=math.nan, nonfinite=-bad))
    return next((r for r in results if not r.ok), results[0])


# -- the per-example prototype --------------------------------------------------------------
@dataclasses.dataclass
class Observed:
    """One side's compared values of an example: ``values`` (outputs and final values of
    mutated arguments, by name) and ``grads`` (gradient per input group, by name)."""

    values: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ExampleVerdict:
    """What :func:`judge_example` found: mismatches, the rule used, notes for the report."""

    mismatches: list[NumericMismatch]
    rule: str
    notes: list[str] = dataclasses.field(default_factory=list)


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.is_complex())


def judge_values(impl: Mapping[str, Any], oracle: Mapping[str, Any] | None,
                 baseline: Mapping[str, Any], *, k: float, floor_ulps: float = FLOOR_ULPS,
                 why: str | None = None) -> list[NumericMismatch]:
    """:func:`judge` every floating value by name (non-floating values are the engine's
    exact comparison); ``oracle`` None: every value falls back to the dtype default."""
    out = []
    for name, a in impl.items():
        b = baseline.get(name)
        o = None if oracle is None else oracle.get(name)
        if not (_floating(a) and _floating(b)) or a.shape != b.shape:
            continue
        if o is not None and (not _floating(o) or o.shape != a.shape):
            o = None
        m = judge(a, o, b, k=k, floor_ulps=floor_ulps, dtype=a.dtype, path=name,
                  why=why if o is None else None)
        if m is not None:
            out.append(m)
    return out


def judge_example(ref: Callable[..., Any], oracle_args: Any, impl: Observed, baseline: Observed,
                  *, pair: Callable[[Any], dict[str, torch.Tensor]],
                  leaves: Mapping[str, torch.Tensor] | None = None,
                  cotangent: Mapping[str, torch.Tensor] | None = None,
                  k: Mapping[str, float] = K_DEFAULTS, floor_ulps: float = FLOOR_ULPS
                  ) -> ExampleVerdict:
    """Everything numeric about one example, given the implementation's and the baseline's
    observations: one oracle call of ``ref`` on ``oracle_args`` (float64, requiring grad where
    the side does), ``pair`` naming its compared values like ``impl.values``, then the oracle's
    VJP with ``cotangent`` (by value name, upcast) w.r.t. ``leaves`` (by gradient name).
    Results already at float64 have no more precise oracle: they use the dtype default."""
    notes: list[str] = []
    runs = run_reference(ref, oracle_args)
    why = None
    if runs.oracle_error is not None:
        why = (f"the reference raised {type(runs.oracle_error).__name__} in float64: "
               f"{str(runs.oracle_error)[:120]}")
        notes.append(f"no float64 oracle ({why}); compared with the per-dtype default tolerance")
    oracle_values = None if why else pair(runs.oracle)
    precise = {n for n, a in impl.values.items()
               if _floating(a) and oracle_dtype(a.dtype) == a.dtype}
    if oracle_values is not None and precise:
        oracle_values = {n: v for n, v in oracle_values.items() if n not in precise}
    found = judge_values(impl.values, oracle_values, baseline.values, k=k["outputs"],
                         floor_ulps=floor_ulps, why=why or "float64 has no more precise oracle")
    if impl.grads and leaves and cotangent and oracle_values is not None:
        oracle_grads = _oracle_vjp(oracle_values, leaves, cotangent, notes)
        found += judge_values(impl.grads, oracle_grads, baseline.grads, k=k["gradients"],
                              floor_ulps=floor_ulps, why="the reference's float64 backward "
                              "failed")
    rule = "dtype-default" if why else "baseline"
    return ExampleVerdict(found, rule, notes)


def _oracle_vjp(values: Mapping[str, torch.Tensor], leaves: Mapping[str, torch.Tensor],
                cotangent: Mapping[str, torch.Tensor],
                notes: list[str]) -> dict[str, torch.Tensor] | None:
    names = [n for n in cotangent if n in values and values[n].requires_grad]
    if not names:
        notes.append("the float64 oracle's result does not require grad; gradients need "
                     "finite differences (check_vjp_fd)")
        return None
    outs = [values[n] for n in names]
    cots = [cotangent[n].detach().to(device=o.device, dtype=o.dtype) for n, o in zip(names, outs)]
    try:
        grads = torch.autograd.grad(outs, list(leaves.values()), cots, allow_unused=True)
    except BaseException as e:  # the reference's backward raised in float64
        if not user_error(e):
            raise
        notes.append(f"the float64 oracle's backward raised {type(e).__name__}; gradients "
                     "compared with the per-dtype default")
        return None
    return {n: torch.zeros_like(l) if g is None else g.detach()
            for (n, l), g in zip(leaves.items(), grads)}


def leaves_named(tree: Any) -> Iterable[tuple[str, Any]]:
    """``(keystr path, leaf)`` pairs of a pytree, for naming compared values."""
    return [(keystr(p), v) for p, v in tree_flatten_with_path(tree)[0]]
