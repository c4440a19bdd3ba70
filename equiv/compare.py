"""Tolerance-aware pytree comparison built on ``torch.testing.assert_close``."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

import numpy as np
import torch

from equiv._compat import default_tolerances, equal, keystr, numpy_view, tree_flatten_with_path
from equiv._explain import explaining
from equiv.errors import user_error
from equiv.examples import tensor_summary

#: bound at import: a spec that replaces ``torch.equal`` or ``torch.testing.assert_close``
#: cannot change how later specs are compared (:func:`equiv._compat.equal` binds its own)
_equal = equal
_assert_close = torch.testing.assert_close
_isclose = torch.isclose

@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One leaf that differs: where, how, and the numbers."""

    path: str
    message: str  # assert_close's lines (count, greatest differences, allowed tolerance)
    max_abs: float | None = None
    max_rel: float | None = None
    index: tuple[int, ...] | None = None


#: per-dtype (rtol, atol) overriding assert_close's defaults for the current run
_DTYPE_TOLERANCES: contextvars.ContextVar[dict[torch.dtype, tuple[float, float]]] = \
    contextvars.ContextVar("equiv_dtype_tolerances", default={})


@contextlib.contextmanager
def dtype_tolerances(table: dict[torch.dtype, tuple[float, float]]) -> Iterator[None]:
    """Within the block, comparisons without an explicit rtol/atol use ``table[dtype]``."""
    token = _DTYPE_TOLERANCES.set(dict(table))
    try:
        yield
    finally:
        _DTYPE_TOLERANCES.reset(token)


#: torch.testing.assert_close's default (rtol, atol) per dtype; other dtypes compare exactly
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7), torch.complex32: (1e-3, 1e-5), torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def dtype_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The (rtol, atol) a comparison without explicit tolerances uses for ``dtype``: the
    current run's override (``dtype_tolerances``), else torch.testing's default."""
    override = _DTYPE_TOLERANCES.get().get(dtype)
    if override is not None and override[0] is not None:
        return override
    return DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))


def dtype_tolerance_overridden(dtype: torch.dtype) -> bool:
    """True when the current run gives ``dtype`` its own tolerance (``settings(tolerances=)``):
    that tolerance is absolute, like a spec's ``rtol``/``atol``."""
    override = _DTYPE_TOLERANCES.get().get(dtype)
    return override is not None and override[0] is not None


def _flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    leaves, spec = tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return [(keystr(p), v) for p, v in leaves], spec


#: elements per chunk of :func:`_numbers`'s float64 temporaries (2 MiB each)
_CHUNK = 1 << 18


def _numbers(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float, tuple[int, ...]]:
    """(greatest absolute difference, greatest relative difference, the index of the first)
    in float64 (complex128), NaN equal to NaN, any other NaN an infinite difference; read in
    chunks of :data:`_CHUNK` elements."""
    a = actual.detach().to("cpu").reshape(-1)
    e = expected.detach().to("cpu").reshape(-1)
    if a.numel() == 0:
        return 0.0, 0.0, ()
    wide = torch.complex128 if a.is_complex() or e.is_complex() else torch.float64
    max_abs, max_rel, flat = -1.0, 0.0, 0
    for i in range(0, a.numel(), _CHUNK):
        a_c, e_c = a[i:i + _CHUNK].to(wide), e[i:i + _CHUNK].to(wide)
        diff = (a_c - e_c).abs()
        both_nan = torch.isnan(a_c.abs() if a_c.is_complex() else a_c) & torch.isnan(
            e_c.abs() if e_c.is_complex() else e_c)
        diff = torch.nan_to_num_(diff.masked_fill_(both_nan, 0.0), nan=float("inf"))
        j = int(diff.argmax())
        if float(diff[j]) > max_abs:
            max_abs, flat = float(diff[j]), i + j
        rel = diff.div_(e_c.abs().clamp_min_(torch.finfo(torch.float64).tiny))
        max_rel = max(max_rel, float(torch.nan_to_num_(rel, nan=float("inf")).max()))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape)) \
        if actual.dim() else ()
    return max_abs, max_rel, index


def compare_leaf(actual: Any, expected: Any, *, rtol: float | None, atol: float | None,
                 path: str = "", exact: bool = False, numbers: bool = True) -> Mismatch | None:
    """Compare one value; ``exact`` demands bitwise equality (NaN equal to NaN).
    ``numbers=False``: while failures are only judged, a tensor mismatch comes without its
    numbers (greatest differences, index)."""
    if expected is None or actual is None:
        if actual is expected:
            return None
        return Mismatch(path, f"expected {_short(expected)}, got {_short(actual)}")
    a_t, e_t = isinstance(actual, torch.Tensor), isinstance(expected, torch.Tensor)
    if a_t != e_t:
        return Mismatch(path, f"expected {_short(expected)}, got {_short(actual)}")
    if a_t:
        return _compare_tensors(actual, expected, rtol=rtol, atol=atol, path=path, exact=exact,
                                numbers=numbers)
    if not (_numeric(actual) and _numeric(expected)):
        return _compare_objects(actual, expected, path)
    return _compare_numbers(actual, expected, rtol=rtol, atol=atol, path=path, exact=exact)


def _compare_tensors(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float | None,
                     atol: float | None, path: str, exact: bool,
                     numbers: bool = True) -> Mismatch | None:
    """Two tensors: bitwise equal, else within tolerance, else the numbers of the mismatch."""
    if actual.dtype == expected.dtype == torch.complex32:
        # no comparison kernels for complex32: compare in complex64 at complex32's tolerance
        if rtol is None and not exact:
            rtol, atol = dtype_tolerance(torch.complex32)
        actual, expected = actual.to(torch.complex64), expected.to(torch.complex64)
    if actual.layout != torch.strided or expected.layout != torch.strided:
        if actual.layout != expected.layout:
            return Mismatch(path, f"expected layout {expected.layout}, got {actual.layout}")
        actual, expected = actual.to_dense(), expected.to_dense()
    if (actual.dtype == expected.dtype and actual.shape == expected.shape
            and actual.device == expected.device and _equal(actual, expected)):
        return None  # fast path: bitwise equal (NaN never is, so those take the full path)
    if exact:
        rtol, atol = 0.0, 0.0
    if rtol is None:
        rtol, atol = _DTYPE_TOLERANCES.get().get(expected.dtype, (None, None))
    fast = None if exact else _close_fast(actual, expected, rtol, atol)
    if fast:
        return None
    if not explaining():  # only the verdict is read: no message
        return _judged(actual, expected, rtol, atol, path, numbers, far=fast is False)
    lines = _not_close(actual, expected, rtol, atol)
    if lines is None:
        return None
    if actual.shape == expected.shape and actual.dtype == expected.dtype:
        max_abs, max_rel, index = _numbers(actual, expected)
        return Mismatch(path, "\n".join(lines), max_abs, max_rel, index)
    return Mismatch(path, "\n".join(lines))


#: the dtypes :func:`_judged` compares as ``assert_close`` does, with ``torch.isclose``
_CLOSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _judged(actual: torch.Tensor, expected: torch.Tensor, rtol: float | None,
            atol: float | None, path: str, numbers: bool = True,
            far: bool = False) -> Mismatch | None:
    """:func:`_compare_tensors`'s verdict without ``assert_close``'s message: for two floating
    tensors of one dtype, shape and device, its test (``torch.isclose``, NaN equal to NaN, at
    the dtype's default tolerance when none is given) and the numbers; other pairs take the
    full path. ``numbers``: with the greatest differences and their index; ``far``: an element
    is already known to fail the test (:func:`_close_fast`)."""
    found = (rtol, atol) if rtol is not None else default_tolerances(actual.dtype)
    if found is None or not (actual.dtype == expected.dtype and actual.dtype in _CLOSE_DTYPES
                             and actual.shape == expected.shape
                             and actual.device == expected.device):
        lines = _not_close(actual, expected, rtol, atol)
        return None if lines is None else Mismatch(path, "\n".join(lines))
    rtol, atol = found
    with torch.no_grad():
        if not far and bool(_isclose(actual.detach(), expected.detach(), rtol=rtol, atol=atol,
                                     equal_nan=True).all()):
            return None
    text = f"Tensor-likes are not close (rtol={rtol:g}, atol={atol:g})."
    return Mismatch(path, text, *_numbers(actual, expected)) if numbers else Mismatch(path, text)


def _compare_numbers(actual: Any, expected: Any, *, rtol: float | None, atol: float | None,
                     path: str, exact: bool) -> Mismatch | None:
    """Python and NumPy numbers: a bool against a number differs in type, as ``1`` against
    ``1.0`` does; what ``assert_close`` cannot pair compares by type and ``==``."""
    if _boolean(actual) != _boolean(expected):
        return Mismatch(path, f"The types do not match: expected {_short(expected)}, got "
                              f"{_short(actual)}.")
    if exact:
        rtol, atol = 0.0, 0.0
    try:
        lines = _not_close(actual, expected, rtol, atol)
    except (TypeError, RuntimeError):  # a pair of types assert_close has no comparison for
        return _compare_objects(actual, expected, path)
    return None if lines is None else Mismatch(path, "\n".join(lines))


def _not_close(actual: Any, expected: Any, rtol: float | None,
               atol: float | None) -> list[str] | None:
    """``assert_close``'s lines saying how the two differ (NaN equal to NaN, strides ignored),
    or None when they are close."""
    kwargs: dict[str, Any] = {"equal_nan": True, "check_stride": False}
    if rtol is not None:
        kwargs.update(rtol=rtol, atol=atol)
    try:
        _assert_close(actual, expected, **kwargs)
    except AssertionError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return lines[1:] if lines and lines[0].endswith("are not close!") else lines
    return None


def _boolean(x: Any) -> bool:
    """A Python or NumPy bool (scalar)."""
    return isinstance(x, bool) or (type(x).__module__ == "numpy"
                                   and getattr(x, "dtype", None) is not None
                                   and x.dtype.kind == "b" and getattr(x, "ndim", 1) == 0)


#: below this many elements assert_close's own check is as fast
_FAST_CLOSE_MIN = 4096


def _close_fast(actual: torch.Tensor, expected: torch.Tensor, rtol: float | None,
                atol: float | None) -> bool | None:
    """True when every element of two float32/float64 tensors of one shape satisfies
    ``|actual - expected| <= atol + rtol * |expected|``: the test ``torch.isclose`` makes, in
    the same dtype, without its NaN and infinity handling; False when an element with a finite
    difference fails it (``torch.isclose`` rejects that element too); None when undecided (a
    non-finite difference, or a pair this test does not take: the full path decides).
    (``torch.isclose`` is about ten times slower on CPU at a million elements.)"""
    if (actual.dtype not in (torch.float32, torch.float64) or actual.dtype != expected.dtype
            or actual.shape != expected.shape or actual.device != expected.device
            or actual.numel() < _FAST_CLOSE_MIN):
        return None
    if rtol is None:
        found = default_tolerances(actual.dtype)
        if found is None:
            return None
        rtol, atol = found
    a, e = numpy_view(actual), numpy_view(expected)
    if a is not None and e is not None:  # the same operations in the same dtype, in NumPy
        with np.errstate(all="ignore"):  # inf - inf is NaN, and fails the test, silently
            diff = np.subtract(a, e)
            np.abs(diff, out=diff)
            bound = np.abs(e)
            bound *= bound.dtype.type(rtol)
            bound += bound.dtype.type(atol)
            ok = np.less_equal(diff, bound)
            if ok.all():
                return True
            np.logical_not(ok, out=ok)
            return False if bool((ok & np.isfinite(diff)).any()) else None
    with torch.no_grad():
        bound = expected.detach().abs().mul_(rtol).add_(atol)
        diff = (actual.detach() - expected.detach()).abs_()
        ok = diff.le(bound)
        if bool(ok.all()):
            return True
        return False if bool((~ok & torch.isfinite(diff)).any()) else None


def _numeric(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex)) or type(x).__module__ == "numpy"


def _compare_objects(actual: Any, expected: Any, path: str) -> Mismatch | None:
    """Leaves that are neither tensors nor numbers (strings, enums, objects) compare by type
    and ``==``."""
    try:
        same = type(actual) is type(expected) and bool(actual == expected)
    except BaseException as e:  # an object whose == raises or is not a truth value
        if not user_error(e):
            raise
        same = actual is expected
    if same:
        return None
    return Mismatch(path, f"expected {_short(expected)}, got {_short(actual)} (compared with ==)")


def align(actual: Any, expected: Any) -> Any:
    """``actual`` with every dict's keys in ``expected``'s order where the two dicts have the
    same keys (dicts compare by key, not by insertion order); otherwise unchanged."""
    if type(actual) is dict and type(expected) is dict:
        if actual.keys() != expected.keys():
            return actual
        items = {k: align(actual[k], expected[k]) for k in expected}
        same = list(actual) == list(items) and all(items[k] is actual[k] for k in items)
        return actual if same else items
    if isinstance(actual, (list, tuple)) and type(actual) is type(expected) \
            and len(actual) == len(expected):
        items = [align(a, e) for a, e in zip(actual, expected)]
        if all(i is a for i, a in zip(items, actual)):
            return actual
        if isinstance(actual, list):
            return items
        return type(actual)(*items) if hasattr(actual, "_fields") else type(actual)(items)
    return actual


def compare_trees(actual: Any, expected: Any, *, rtol: float | None, atol: float | None,
                  root: str = "output", exact: bool = False) -> list[Mismatch]:
    """Every differing leaf of two pytrees; a structure difference is one mismatch."""
    actual = align(actual, expected)
    a_leaves, a_spec = _flatten(actual)
    e_leaves, e_spec = _flatten(expected)
    if a_spec != e_spec:
        return [Mismatch(root, f"structure differs: expected {_structure(expected)}, got "
                               f"{_structure(actual)}")]
    out = []
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        m = compare_leaf(a, e, rtol=rtol, atol=atol, path=root + path, exact=exact)
        if m is not None:
            out.append(m)
    return out


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor {tensor_summary(x)}"
    return f"{type(x).__name__} {x!r:.60}"


def _structure(tree: Any) -> str:
    leaves, spec = _flatten(tree)
    if len(leaves) == 1 and leaves[0][0] == "":
        return _short(leaves[0][1])
    kinds = ", ".join(f"{p}: {_short(v)}" for p, v in leaves[:6])
    more = f", ... ({len(leaves)} leaves)" if len(leaves) > 6 else ""
    return f"{type(tree).__name__} {{{kinds}{more}}}"
