"""The term-magnitude floor of outputs and gradients: how far rounding of the reference's
intermediates can move each output (or each gradient of its VJP, the backward's ops perturbed
too), estimated by running the reference in float64 with every arithmetic op's result perturbed
by a random relative error of the compute precision's size (Monte Carlo arithmetic).

A correct kernel that computes ``x - mean(x)`` with ``|x| >> |x - mean|`` keeps the rounding of
``x`` and of the mean, although the result is small: ``|oracle|`` understates the size of the
terms that cancel. Perturbing each intermediate (the mean included) by ``eps * |value|`` shows
that size where the float64 run alone cannot (a group of one element cancels exactly). Views,
copies, selections and comparisons round nothing and are left alone; a fused aten kernel with a
decomposition in torch (``native_group_norm``, ``native_layer_norm``...) runs as its
decomposition, so its intermediates are perturbed too.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch

from equiv._compat import TorchDispatchMode, decompositions, equal, tree_flatten, tree_map

#: the relative size of each simulated rounding: float32's eps (twice its unit roundoff). A
#: float16/bfloat16 kernel computes in float32 and rounds its result once (the ULP floor)
COMPUTE_EPS = torch.finfo(torch.float32).eps
#: perturbed runs of the reference whose differences are averaged (root mean square)
PROBES = 3
#: bound at import: a spec that replaces ``torch.equal`` cannot change this probe
_equal = equal  # torch.equal, through NumPy for large CPU tensors (equiv._compat.equal)
#: elements of an op's result perturbed at a time in place (a 2 MiB factor)
_CHUNK = 1 << 18

#: aten ops whose results are exact (no rounding): moving, selecting, comparing, creating
_EXACT = frozenset((
    "clone", "copy", "copy_", "_to_copy", "to", "detach", "alias", "lift_fresh", "cat", "stack",
    "index", "index_select", "gather", "scatter", "select_scatter", "slice_scatter", "where",
    "masked_fill", "masked_fill_", "neg", "abs", "max", "min", "amax", "amin", "maximum",
    "minimum", "clamp", "clamp_min", "clamp_max", "relu", "sort", "topk", "zeros", "ones",
    "full", "empty", "empty_like", "zeros_like", "ones_like", "full_like", "fill", "fill_",
    "zero_", "new_zeros", "new_empty", "new_ones", "new_full", "empty_strided", "scalar_tensor",
    "constant_pad_nd", "flip", "roll", "repeat", "sign", "sgn", "floor", "ceil", "round",
    "trunc", "eq", "ne", "lt", "gt", "le", "ge", "argmax", "argmin", "nonzero", "arange",
    "_unsafe_view", "view", "reshape", "expand", "permute", "t", "transpose", "squeeze",
    "unsqueeze", "select", "slice", "as_strided", "unbind", "split", "chunk", "narrow",
    "contiguous", "index_put", "index_put_", "_local_scalar_dense", "item", "resize_",
    "set_", "isnan", "isinf", "isfinite", "logical_and", "logical_or", "logical_not", "bitwise_and",
    "bitwise_or", "bitwise_not", "native_dropout", "bernoulli", "bernoulli_", "rand",
    "randn", "randint", "rand_like", "randn_like", "normal", "normal_", "uniform_",
))


class _Perturbed(TorchDispatchMode):
    """Every floating result of an arithmetic op multiplied by ``1 + rel * r``, ``r`` uniform in
    ``[-1, 1]`` per element, drawn from ``gen`` (``rel == 0``: the same run, unperturbed); a
    result below float64 moved by one ULP instead (:meth:`_moved`)."""

    def __init__(self, rel: float, gen: torch.Generator) -> None:
        super().__init__()
        self.rel, self.gen = rel, gen
        self.table, self.inside = decompositions(), set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _EXACT or getattr(func, "is_view", False):
            return func(*args, **kwargs)
        mutable = func._schema.is_mutable
        if not mutable and func in self.table and func not in self.inside:
            out = self._decomposed(func, args, kwargs)  # a fused kernel's own intermediates
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if self.rel == 0:
            return out
        summed = _summed(name, args, out)
        if mutable:  # in place or out=: the written tensor holds the result
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if _floating(t):
                    t.copy_(self._moved(t, summed))
            return out
        read = _storages((args, kwargs))
        return tree_map(lambda t: self._moved(t, summed, owned=_owned(t, read))
                        if _floating(t) else t, out)

    def _moved(self, t: torch.Tensor, summed: float = 1.0, owned: bool = False) -> torch.Tensor:
        """``t`` times ``1 + rel * r`` in float64 (and complex); below float64, where that
        product mostly rounds back to ``t``, ``sqrt(summed)`` ULPs of ``t``'s dtype up or down
        at random per element (the roundings of a reduction over ``summed`` terms add up): a
        new tensor, or ``t`` itself multiplied chunk by chunk where it is ``owned`` (an op's
        new result, no input's memory) dense float64 on the CPU: the same numbers, no copy.
        A dtype coarser than ``rel`` (a bfloat16 intermediate of a float32 run) is left alone:
        its own rounding is not the precision the run is judged at."""
        if t.dtype == torch.float64 and owned and t.device.type == "cpu" and t.is_contiguous():
            flat = t.view(-1)  # the generator fills chunk after chunk as it fills the whole
            for i in range(0, flat.numel(), _CHUNK):
                part = flat[i:i + _CHUNK]
                part.mul_(self._factor(part))
            return t
        if t.dtype == torch.float64 or t.is_complex():
            return self._factor(t).mul_(t)
        if torch.finfo(t.dtype).eps > self.rel * 1.001:  # coarser than the simulated rounding
            return t
        sign = (torch.rand(t.shape, generator=self.gen) < 0.5).to(t.device, t.dtype) * 2 - 1
        step = torch.nextafter(t, torch.full_like(t, float("inf"))) - t
        return torch.where(torch.isfinite(step), t + step * sign * math.sqrt(summed), t)

    def _decomposed(self, func: Any, args: Any, kwargs: Any) -> Any:
        self.inside.add(func)
        try:
            with self:
                return self.table[func](*args, **kwargs)
        finally:
            self.inside.discard(func)

    def _factor(self, t: torch.Tensor) -> torch.Tensor:
        """``1 + rel * r`` per element of ``t``, a new tensor (computed in place: one copy)."""
        r = torch.rand(t.shape, generator=self.gen, dtype=torch.float64)
        return r.mul_(2).sub_(1).mul_(self.rel).add_(1).to(device=t.device, dtype=t.dtype)


#: aten ops that sum over their inputs: the inner length of a product, the reduced elements
_PRODUCTS = frozenset(("mm", "bmm", "matmul", "mv", "dot", "vdot"))
_ADDED_PRODUCTS = frozenset(("addmm", "baddbmm", "addbmm", "addmv"))
_REDUCTIONS = frozenset(("sum", "mean", "nansum", "nanmean", "prod", "var", "std", "var_mean",
                         "std_mean", "norm", "linalg_vector_norm", "logsumexp"))
#: ops that sum along one dim (``args[1]``) and keep the input's shape
_SCANS = frozenset(("cumsum", "cumprod", "_softmax", "_log_softmax", "softmax", "log_softmax"))


def _summed(name: str, args: Any, out: Any) -> float:
    """How many terms each element of an op's result sums (1 for elementwise ops): the inner
    length of a matrix product, the length of a scan's dim, else the input's elements per
    result element of a reduction."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return 1.0
    if name in _PRODUCTS and tensors[0].dim():
        return float(tensors[0].shape[-1])
    if name in _ADDED_PRODUCTS and len(tensors) > 1 and tensors[1].dim():
        return float(tensors[1].shape[-1])
    if name in _SCANS and tensors[0].dim():
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        return float(tensors[0].shape[dim])
    first = out[0] if isinstance(out, (tuple, list)) else out
    if name in _REDUCTIONS and isinstance(first, torch.Tensor):
        return max(tensors[0].numel() / max(first.numel(), 1), 1.0)
    return 1.0


def _same(a: torch.Tensor, b: Any, spread: torch.Tensor | None = None) -> bool:
    """Equal up to float64 rounding (a decomposed kernel sums in another order): relative to
    the larger value, or elementwise within a thousandth of ``spread`` (float64 rounds the
    terms of a cancelling value ~1e-9 times as much as the simulated float32 rounding does).
    Read in chunks of :data:`_CHUNK` elements."""
    if not (isinstance(b, torch.Tensor) and a.shape == b.shape):
        return False
    if a.dtype == b.dtype and a.device == b.device and _equal(a, b):
        return True
    flat = [t.detach().reshape(-1) for t in (a, b)]

    def chunks() -> Iterator[tuple[torch.Tensor, torch.Tensor, slice]]:
        for i in range(0, a.numel(), _CHUNK):
            at = slice(i, i + _CHUNK)
            yield (*(torch.nan_to_num(t[at].to("cpu", torch.float64)) for t in flat), at)

    size = [0.0, 0.0]
    for x, y, _ in chunks():
        size = [max(size[0], float(x.abs().max())), max(size[1], float(y.abs().max()))]
    if all(bool(((x - y).abs_() <= 1e-9 * (size[1] + size[0])).all()) for x, y, _ in chunks()):
        return True
    if spread is None:
        return False
    s = spread.detach().reshape(-1)
    return all(bool(((x - y).abs_() <= 1e-3 * s[at].to("cpu", torch.float64)).all())
               for x, y, at in chunks())


def _identical(a: torch.Tensor, b: Any) -> bool:
    return (isinstance(b, torch.Tensor) and a is not b and a.dtype == b.dtype
            and a.device == b.device and a.shape == b.shape and _equal(a, b))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storages(tree: Any) -> set[int | None]:
    """The storages the tensors of ``tree`` are in (None for a tensor without one)."""
    out: set[int | None] = set()
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            try:
                out.add(_storage(t))
            except (RuntimeError, NotImplementedError):  # sparse, a wrapper subclass...
                out.add(None)
    return out


def _owned(t: torch.Tensor, read: set[int | None]) -> bool:
    """``t`` is in memory none of ``read``'s storages is (nor an unknown one)."""
    if None in read:
        return False
    try:
        return _storage(t) not in read
    except (RuntimeError, NotImplementedError):
        return False


def _shared_storages(values: dict[str, Any]) -> set[int]:
    """The storages that more than one of ``values``' tensors reach."""
    seen: set[int] = set()
    shared: set[int] = set()
    for v in values.values():
        if isinstance(v, torch.Tensor):
            (shared if _storage(v) in seen else seen).add(_storage(v))
    return shared


def _difference(m: torch.Tensor, b: torch.Tensor, owned: bool) -> torch.Tensor:
    """``m - b`` in float64 on the CPU, written into ``m`` when ``owned`` (a perturbed run's
    result that no other value shares) and ``m`` is a dense float64 CPU tensor filling its
    storage: no new copy."""
    b = b.detach().to("cpu", torch.float64)
    m = m.detach()
    if owned and m.dtype == torch.float64 and m.device.type == "cpu" and m.is_contiguous() \
            and m.untyped_storage().nbytes() == m.numel() * 8 and _storage(m) != _storage(b):
        return m.sub_(b)
    return m.to("cpu", torch.float64) - b


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel() > 0


def rounding_spread(run: Callable[[], dict[str, Any] | None], oracle: dict[str, Any] | None,
                    seed: int, rel: float = COMPUTE_EPS, probes: int = PROBES,
                    inputs: Iterable[torch.Tensor] = ()) -> dict[str, torch.Tensor]:
    """Per compared value (by name), the root mean square over ``probes`` runs of how far
    perturbing every intermediate by ``rel`` moves it (float64, absolute). ``run()`` calls the
    reference once on a fresh float64 copy and returns its values by name (None: it raised);
    it may differentiate too (a VJP's gradients: the backward's ops are dispatched through the
    perturbing mode as well). ``oracle``: the oracle's values. Empty when the reference is not
    repeatable (its unperturbed rerun under the probe differs from ``oracle`` beyond float64
    rounding: random draws, stale memory) or computes outside torch's dispatcher (NumPy:
    nothing to perturb). ``inputs``: tensors ``run`` hands the reference that the spread must
    not write into (a value the reference returns as it is shares their memory)."""
    kept = _storages(list(inputs))
    gen = torch.Generator().manual_seed(seed)
    with _Perturbed(0.0, gen):
        base = run()
    if not base:
        return {}
    floating = {n: b for n, b in base.items() if _floating(b)}
    oracle = floating if oracle is None else oracle
    strict = all(_same(b, oracle.get(n)) for n, b in floating.items())
    if not strict and not all(isinstance(oracle.get(n), torch.Tensor) for n in floating):
        return {}
    # the oracle's values stand for the unperturbed rerun's where they are bitwise the same:
    # one copy fewer held while the perturbed runs go
    floating = {n: oracle[n] if _identical(b, oracle.get(n)) else b for n, b in floating.items()}
    del base
    squares: dict[str, torch.Tensor] = {}
    for _ in range(probes):
        with _Perturbed(rel, gen):
            moved = run()
        if not moved:
            return {}
        shared = _shared_storages(moved) | kept
        for name, b in floating.items():
            m = moved.pop(name, None)
            if not (isinstance(m, torch.Tensor) and m.shape == b.shape):
                continue
            d = _difference(m, b, owned=_storage(m) not in shared)
            d = d.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).square_()
            squares[name] = squares[name].add_(d) if name in squares else d
            del m, d
        del moved
    spread = {n: s.div_(probes).sqrt_() for n, s in squares.items()}  # in place: no copy
    if not strict and not all(_same(b, oracle.get(n), spread.get(n))
                              for n, b in floating.items()):
        return {}
    return spread
