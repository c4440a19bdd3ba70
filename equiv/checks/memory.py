"""``memory``: the memory contract, only where the spec declares one (``max_memory_ratio=``,
``max_retained_bytes=``): peak bytes over forward + backward and bytes the graph keeps alive after
forward, measured by the core's storage tracker (:mod:`equiv.memory`)."""

from __future__ import annotations

from equiv.execution.record import Execution, Sink
from equiv.memory import memory_table

NAME = "memory"


def run(ex: Execution, sink: Sink) -> None:
    spec = ex.spec
    if spec.max_memory_ratio is None and spec.max_retained_bytes is None:
        return
    impl = ex.measure("impl")
    ref = ex.measure("ref")
    if impl is None or ref is None:
        return
    table = memory_table(impl, ref)
    top = impl.retained_by[0][0] if impl.retained_by else None
    if spec.max_retained_bytes is not None and impl.retained_bytes > spec.max_retained_bytes:
        holders = "\n".join(f"  {b:>12,} B  {what}" for what, b in impl.retained_by[:5])
        sink.finding(
            NAME,
            f"the graph keeps {impl.retained_bytes:,} B alive after forward, more than "
            f"max_retained_bytes={spec.max_retained_bytes:,}.",
            argument=top, details=f"{table}\nkept alive by (unique storages):\n{holders}",
            likely_cause=f"{top} retains its whole storage until backward."
                         if top else None,
            fix="save a compact copy (.clone() of the small view) or recompute in backward, so "
                "the large storage can be freed after forward.",
        )
    if spec.max_memory_ratio is not None and ref.peak_bytes > 0:
        ratio = impl.peak_bytes / ref.peak_bytes
        if ratio > spec.max_memory_ratio:
            sink.finding(
                NAME,
                f"peak memory over forward + backward is {ratio:.2f}x the reference's, more "
                f"than max_memory_ratio={spec.max_memory_ratio:g}.",
                argument=top, details=table,
                fix="avoid temporaries (in-place where safe) or relax max_memory_ratio=.",
            )
