"""The ``vmap`` and ``jvp`` runs of both sides, through the core.

``vmap``: ``torch.func.vmap`` of the implementation against ``vmap`` of the reference, with the
batch dimension placed first and then last (a hand-written vmap rule that ignores ``in_dims``
shows here); and batched gradients (gradcheck's ``check_batched_grad``): the implementation's
backward for a batch of cotangents at once (``torch.autograd.grad(..., is_grads_batched=True)``,
vmap over the VJP) against the reference's VJP for each cotangent. ``jvp``: ``torch.func.jvp`` of (returned outputs, final values of mutated arguments)
of both sides for one random tangent. A side that cannot run under the transform makes the mode
unsupported (skipped with the reason), never a pass. Each run is a record the checks read, like
:class:`~equiv.execution.record.Execution`.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import torch

from torch.overrides import TorchFunctionMode

from equiv._compat import op_types, tree_flatten, tree_unflatten
from equiv._settings import settings as Settings
from equiv.compare import compare_leaf
from equiv.errors import error_text
from equiv.examples import Args, Template
from equiv.execution.calls import clone_tree, cotangent, isolated, leaves, user_error, vjp
from equiv.execution.pairing import split
from equiv.execution.record import Placement, Sink, execute
from equiv.modes import normalise_error
from equiv.spec import Spec

BATCH = 3

_VMAP_UNSUPPORTED = ("vmap", "Batching rule", "generate_vmap_rule", "batched")
# a backward that cannot run batched for want of a batching rule (a skip, not a finding)
_BATCHED_UNSUPPORTED = ("Batching rule not implemented", "does not have vmap support",
                        "not supported with vmap", "doesn't support vmap")
_JVP_UNSUPPORTED = ("forward AD", "forward-mode", "jvp", "Forward AD", "not implemented",
                    "NotImplementedError")


class Unsupported(Exception):
    """A side cannot run under the transform: the mode is skipped with this reason."""


class TransformRun:
    """One transform run of both sides on one example (a record the checks read)."""

    kind = ""

    def __init__(self, spec: Spec, cfg: Settings, mode: str, device: str,
                 template: Template) -> None:
        self.spec, self.cfg, self.mode, self.device = spec, cfg, mode, device
        self.template = template
        self.impl_exc: BaseException | None = None
        self.valid = True


class VmapRun(TransformRun):
    """Both sides under ``vmap`` with the batch dimension at ``dim``."""

    kind = "vmap"

    def __init__(self, *a: Any, dim: int) -> None:
        super().__init__(*a)
        self.dim = dim
        self.where = "first (in_dims=0)" if dim == 0 else "last (in_dims=-1)"
        self.detail = f"batch dimension {self.where}, batch of {BATCH}"
        self.impl_result: Any = None
        self.expected: Any = None
        self.finals: dict[str, Any] = {}
        self.consumed = False
        self.impl_args: tuple[Any, ...] = ()
        self.before: tuple[Any, ...] = ()
        self.example: Args | None = None
        self.cot_seed = 0
        self._batched: list["BatchedVjp | None"] = []

    def batched_vjp(self) -> "BatchedVjp | None":
        """The batched-gradient run of this example (once: on the batch-first run only), or
        None where there is nothing to differentiate or a side raised (other checks report)."""
        if self.dim != 0 or self.example is None:
            return None
        if not self._batched:
            self._batched.append(_batched_vjp(self.spec, self.cfg, self.example, self.cot_seed,
                                              self.mode, self.device))
        return self._batched[0]


class BatchedVjp:
    """The implementation's VJP for :data:`BATCH` cotangents at once (vmap over the backward)
    and the reference's VJP for each, stacked: one tensor per gradient leaf, by name.
    ``plain_ok``: the implementation's unbatched VJP for the first cotangent matches the
    reference's (so a mismatch is specific to batching). ``unsupported``: why the backward
    cannot run batched (a missing batching rule)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.impl: list[torch.Tensor] = []
        self.expected: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.unsupported: str | None = None
        self.plain_ok = True
        self.detail = f"a batch of {BATCH} cotangents (is_grads_batched=True)"


class JvpRun(TransformRun):
    """Both sides under ``jvp`` for one tangent: primal outputs and tangents, by name."""

    kind = "jvp"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.names: list[str] = []
        self.impl_out: tuple[torch.Tensor, ...] = ()
        self.ref_out: tuple[torch.Tensor, ...] = ()
        self.impl_tan: tuple[torch.Tensor, ...] = ()
        self.ref_tan: tuple[torch.Tensor, ...] = ()


def _shared_storage(template: Template, sink: Sink, what: str) -> bool:
    if any(not g.simple for g in template.groups):
        sink.note(what)
        return True
    return False


def vmap_runs(spec: Spec, cfg: Settings, example: Args, cot_seed: int, mode: str,
              device: str, sink: Sink) -> Iterator[VmapRun]:
    """The vmap runs of one example: batch dimension first, then last (the caller stops after
    a run with findings). Raises :class:`Unsupported`."""
    template = Template(spec.signature, example, spec.mutates.keys())
    sink.template, sink.dtype = template, template.dtype
    if _shared_storage(template, sink, "vmap: examples whose arguments share storage (views, "
                       "the same tensor twice) are not batched; they are checked in the other "
                       "modes"):
        return
    base = template.instantiate(grad=False, device=device)
    if any(isinstance(v, torch.Tensor) for v in tree_flatten(base.bound.kwargs)[0]):
        sink.note("vmap: tensor keyword arguments are not batched; such examples are checked "
                  "in the other modes only")
        return
    gen = torch.Generator().manual_seed(cot_seed)
    for dim in (0, -1):
        r = VmapRun(spec, cfg, mode, device, template, dim=dim)
        r.example, r.cot_seed = example, cot_seed
        _run_vmap(r, base.bound.args, base.bound.kwargs, gen)
        yield r
        if r.impl_exc is not None:
            return


def _batched(args: tuple[Any, ...], dim: int, gen: torch.Generator) -> tuple[Any, Any]:
    flat, treespec = tree_flatten(args)
    out, dims = [], []
    for x in flat:
        if isinstance(x, torch.Tensor):
            samples = [x]
            for _ in range(BATCH - 1):
                noise = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)
                samples.append((x + noise.to(x.dtype)) if x.dtype.is_floating_point else x)
            out.append(torch.stack(samples, dim=dim))
            dims.append(dim)
        else:
            out.append(x)
            dims.append(None)
    return tree_unflatten(out, treespec), tuple(tree_unflatten(dims, treespec))


def _run_vmap(r: VmapRun, args: tuple[Any, ...], kwargs: dict[str, Any],
              gen: torch.Generator) -> None:
    from torch.func import vmap  # loaded when the mode first runs

    spec, dim = r.spec, r.dim
    batched, in_dims = _batched(args, dim, gen)
    ref_args, r.impl_args, r.before = clone_tree(batched), clone_tree(batched), clone_tree(batched)
    try:
        with isolated(), torch.no_grad():
            ref_result = vmap(lambda *a: spec.ref(*a, **kwargs), in_dims=in_dims,
                              out_dims=dim)(*ref_args)
    except BaseException as e:
        if not user_error(e):
            raise
        raise Unsupported(f"unsupported: the reference cannot run under vmap "
                          f"({type(e).__name__}: {error_text(e).splitlines()[0][:160]})") from None
    try:
        with isolated(), torch.no_grad():
            r.impl_result = vmap(lambda *a: spec.impl(*a, **kwargs), in_dims=in_dims,
                                 out_dims=dim)(*r.impl_args)
    except BaseException as e:
        if not user_error(e):
            raise
        e = normalise_error(e)
        text = error_text(e)
        if any(w in text for w in _VMAP_UNSUPPORTED):
            raise Unsupported(f"unsupported: the implementation cannot run under vmap "
                              f"({type(e).__name__}: {text.splitlines()[0][:200]})") from None
        r.impl_exc, r.valid = e, False
        return
    r.expected, r.finals, r.consumed = split(spec, ref_result)  # ReferenceError_ propagates


def _batched_vjp(spec: Spec, cfg: Settings, example: Args, cot_seed: int, mode: str,
                 device: str) -> BatchedVjp | None:
    """Both sides once more (eagerly, through the core); then the implementation's backward
    under vmap for a batch of cotangents, and the reference's VJP for each of them."""

    ex = execute(spec, cfg, example, cot_seed, Placement(mode, "eager", device))
    if not ex.valid or not ex.pairing().ok:
        return None
    pairs, names = ex.pairing().pairs, [ex.template.group_name(g) for g in ex.pairing().groups]
    gen = torch.Generator().manual_seed(cot_seed + 104729)
    cots = [torch.stack([cotangent(i, gen) for _ in range(BATCH)]) for _, i, _ in pairs]
    out = BatchedVjp(names)
    expected = []
    for b in range(BATCH):
        grads, err = vjp([r for _, _, r in pairs], ex.leaves("ref"), [c[b] for c in cots])
        if err is not None:
            return None  # the reference's backward raised: the gradients check notes it
        expected.append(grads)
    out.expected = [torch.stack(g) for g in zip(*expected)]
    plain, err = vjp([i for _, i, _ in pairs], ex.leaves("impl"), [c[0] for c in cots])
    out.plain_ok = err is None and all(
        compare_leaf(a, e[0], rtol=spec.rtol, atol=spec.atol, path=n) is None
        for n, a, e in zip(names, plain, out.expected))
    try:
        with warnings.catch_warnings():  # torch warns where a batching rule falls back to a loop
            warnings.simplefilter("ignore")
            grads = torch.autograd.grad([i for _, i, _ in pairs], ex.leaves("impl"), cots,
                                        retain_graph=True, allow_unused=True,
                                        is_grads_batched=True)
    except BaseException as e:  # the user's backward raised under vmap
        if not user_error(e):
            raise
        text = f"{type(e).__name__}: {error_text(e).splitlines()[0][:200] if error_text(e) else ''}"
        if any(w in error_text(e) for w in _BATCHED_UNSUPPORTED):
            out.unsupported = text
        else:
            out.error = e
        return out
    out.impl = [torch.zeros_like(e) if g is None else g.detach()
                for g, e in zip(grads, out.expected)]
    return out


def jvp_run(spec: Spec, cfg: Settings, example: Args, cot_seed: int, mode: str, device: str,
            sink: Sink) -> JvpRun | None:
    """The jvp run of one example, or None when it has nothing to differentiate. Raises
    :class:`Unsupported`."""
    template = Template(spec.signature, example, spec.mutates.keys())
    sink.template, sink.dtype = template, template.dtype
    if _shared_storage(template, sink, "jvp: examples whose arguments share storage are "
                       "checked in the other modes only"):
        return None
    base = template.instantiate(grad=False, device=device)
    flat, treespec = tree_flatten((base.bound.args, base.bound.kwargs))
    where = [i for i, x in enumerate(flat)
             if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]
    if not where:
        return None
    gen = torch.Generator().manual_seed(cot_seed)
    primals = tuple(flat[i].detach() for i in where)
    tangents = tuple(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p)
                     for p in primals)

    def rebuild(ts: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves_ = list(flat)
        for i, t in zip(where, ts):
            leaves_[i] = t.clone()  # jvp writes through in-place ops: never the caller's tensor
        return tree_unflatten(leaves_, treespec)

    r = JvpRun(spec, cfg, mode, device, template)
    _run_jvp(r, rebuild, primals, tangents)
    return r


def _run_jvp(r: JvpRun, rebuild: Any, primals: tuple[torch.Tensor, ...],
             tangents: tuple[torch.Tensor, ...]) -> None:
    from torch.func import jvp  # loaded when the mode first runs

    spec, mutated, consumed_box = r.spec, list(r.spec.mutates), [False]

    def ref_side(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = rebuild(ts)
        expected, finals, consumed = split(spec, spec.ref(*args, **kwargs))
        consumed_box[0] = consumed
        pairs = [] if consumed else [(f"output{p}", v) for p, v in leaves(expected)]
        for name in mutated:
            pairs += [(f"final value of {name}{p}", v) for p, v in leaves(finals[name])]
        r.names[:] = [n for n, v in pairs if _float(v)]
        return tuple(v for _, v in pairs if _float(v))

    def impl_side(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = rebuild(ts)
        bound = spec.signature.bind(*args, **kwargs)
        result = spec.impl(*args, **kwargs)
        out = [] if consumed_box[0] else tree_flatten(result)[0]
        for name in mutated:
            out += tree_flatten(bound.arguments[name])[0]
        return tuple(x for x in out if _float(x))

    try:
        with isolated():
            r.ref_out, r.ref_tan = jvp(ref_side, primals, tangents)
    except BaseException as e:
        if not user_error(e):
            raise
        raise Unsupported(f"unsupported: the reference has no forward-mode derivative "
                          f"({type(e).__name__}: {error_text(e).splitlines()[0][:160]})") from None
    recorder = _CustomOps()
    try:
        with isolated(), recorder:
            r.impl_out, r.impl_tan = jvp(impl_side, primals, tangents)
    except BaseException as e:
        if not user_error(e):
            raise
        e = normalise_error(e)
        text = f"{type(e).__name__}: {error_text(e)}"
        if any(w in text for w in _JVP_UNSUPPORTED):
            raise Unsupported(f"unsupported: the implementation has no forward-mode "
                              f"derivative ({text.splitlines()[0][:200]})") from None
        r.impl_exc, r.valid = e, False
        return
    if recorder.ops:
        raise Unsupported(
            f"unsupported: the implementation calls custom op(s) {', '.join(recorder.ops)}, "
            "which have no forward-mode derivative (torch.library registers backward formulas "
            "only; jvp drops the tangent through them)")


class _CustomOps(TorchFunctionMode):
    """The names of the custom (non-aten) ops called inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        overload_t, packet_t = op_types()
        if isinstance(func, (overload_t, packet_t)) and func.namespace not in (
                "aten", "prim", "prims") and func.name() not in self.ops:
            self.ops.append(str(func.name()))
        return func(*args, **(kwargs or {}))


def _float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point
