"""Memory per side per example: peak bytes over forward + backward, and the bytes the graph keeps
alive after forward, counted by unique storage (a saved 2x4 view of a 1000x1000 float32 base keeps
~4 MB). CPU: a dispatch-mode storage tracker; CUDA: the allocator's peak statistics.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from equiv._args import Args
from equiv._compat import TorchDispatchMode, tree_flatten
from equiv.errors import InvalidArgument
from equiv.examples import Template, tensor_summary
from equiv.execution.calls import isolated, user_error
from equiv.spec import get_spec
from equiv.timeline import _geometry, ctx_tensors, saved_by


__all__ = ["MemoryComparison", "MemoryStats", "compare_memory", "measure"]


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """One side's memory on one example."""

    peak_bytes: int
    retained_bytes: int
    #: (description of the saved tensor, bytes of the storage it keeps alive), largest first
    retained_by: tuple[tuple[str, int], ...] = ()


class _StorageTracker(TorchDispatchMode):
    """Live bytes of storages created inside the region, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[Any] = set()
        self._finalizers: list[weakref.finalize] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # views and in-place results allocate nothing
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = (st.data_ptr(), st.nbytes())
                if st.nbytes() and key not in self._seen:
                    self._seen.add(key)
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    self._finalizers.append(weakref.finalize(st, self._free, key, st.nbytes()))
        return out

    def _free(self, key: Any, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def close(self) -> None:
        for f in self._finalizers:
            f.detach()


def _retained(outputs: list[torch.Tensor], saved: list[torch.Tensor],
              names: dict[int, str]) -> tuple[int, tuple[tuple[str, int], ...]]:
    """Unique storage bytes of saved tensors and of ctx attributes reachable from ``outputs``."""

    nodes = saved_by(outputs)
    entries = [(t, nodes.get(_geometry(t), "autograd")) for t in saved]
    entries += [(t, f"{type(node).__name__} as ctx.{attr}")
                for node, attr, t in ctx_tensors(outputs)]
    by_storage: dict[Any, tuple[str, int]] = {}
    for t, how in entries:
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if not st.nbytes() or key in by_storage:
            continue
        name = names.get(id(t))
        what = f"{name!r}" if name else "a " + tensor_summary(t).replace(" grad", "")
        logical = t.numel() * t.element_size()
        if logical < st.nbytes():
            what += f" view ({logical:,} B of data) of a {st.nbytes():,} B storage"
        by_storage[key] = (f"{what}, saved by {how}", st.nbytes())
    ranked = tuple(sorted(by_storage.values(), key=lambda e: (-e[1], e[0])))
    return sum(b for _, b in ranked), ranked


def measure(fn: Any, side: Any, cotangent_seed: int = 0) -> MemoryStats | None:
    """Peak and retained bytes of ``fn`` on one side's arguments (forward + one backward).

    Returns None when ``fn`` raises (the error checks report that).
    """
    names = {id(t): slot.path for slot, t in zip(side.template.slots, side.tensors)}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> Any:
        saved.append(t)
        return t

    cuda = any(t.is_cuda for t in side.tensors)
    tracker = _StorageTracker()
    base = 0
    if cuda:  # pragma: no cover - exercised on CUDA machines only
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        with isolated(), torch.enable_grad():
            if cuda:  # pragma: no cover
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = side.call(fn)
            else:
                with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = side.call(fn)
            outs = [o for o in tree_flatten(out)[0]
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            retained, by = _retained(outs, saved, names)
            saved.clear()
            leaves = [l for l in side.leaves if l is not None]
            if outs and leaves:
                gen = torch.Generator().manual_seed(cotangent_seed)
                cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
                        if not o.dtype.is_complex else torch.zeros_like(o) for o in outs]
                if cuda:  # pragma: no cover
                    torch.autograd.grad(outs, leaves, cots, allow_unused=True)
                else:
                    with tracker:
                        torch.autograd.grad(outs, leaves, cots, allow_unused=True)
    except BaseException as e:  # the user's code raised: the error checks report it
        if not user_error(e):
            raise
        return None
    finally:
        tracker.close()
    if cuda:  # pragma: no cover
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = tracker.peak
    return MemoryStats(peak, retained, by)


def retained(fn: Any, side: Any) -> MemoryStats | None:
    """Only the bytes the graph of ``fn``'s forward keeps alive (no tracker, no backward: one
    forward's cost), peak 0; None when ``fn`` raises."""
    names = {id(t): slot.path for slot, t in zip(side.template.slots, side.tensors)}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> int:
        # the graph keeps an index, not the tensor: a saved output holding its own graph is a
        # cycle through C++ that the garbage collector cannot see (nothing runs backward here)
        saved.append(t)
        return len(saved) - 1

    try:
        with isolated(), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, saved.__getitem__):
            out = side.call(fn)
    except BaseException as e:  # the user's code raised: the error checks report it
        if not user_error(e):
            raise
        return None
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    kept, by = _retained(outs, saved, names)
    saved.clear()
    return MemoryStats(0, kept, by)


def memory_table(impl: MemoryStats, ref: MemoryStats) -> str:
    return "\n".join([
        f"{'':<16}{'peak (fwd+bwd)':>18}{'retained after forward':>26}",
        f"{'implementation':<16}{impl.peak_bytes:>16,} B{impl.retained_bytes:>24,} B",
        f"{'reference':<16}{ref.peak_bytes:>16,} B{ref.retained_bytes:>24,} B",
    ])


@dataclasses.dataclass(frozen=True)
class MemoryComparison:
    """Both sides' memory on one example; ``str()`` is the side-by-side table."""

    implementation: MemoryStats
    reference: MemoryStats

    def __str__(self) -> str:
        return memory_table(self.implementation, self.reference)


def compare_memory(impl: Any, *args: Any, **kwargs: Any) -> MemoryComparison:
    """Measure a registered implementation and its reference on one example (the arguments are
    copied, never modified): did the in-place version save memory?

    Raises ``InvalidArgument`` when either side raises on the example.
    """
    spec = get_spec(impl)
    template = Template(spec.signature, Args(*args, **kwargs), spec.mutates.keys())
    impl_stats = measure(spec.impl, template.instantiate())
    ref_stats = measure(spec.ref, template.instantiate())
    if impl_stats is None or ref_stats is None:
        side = "implementation" if impl_stats is None else "reference"
        raise InvalidArgument(f"compare_memory: the {side} raised on this example; pass "
                              "arguments both sides accept.")
    return MemoryComparison(impl_stats, ref_stats)
