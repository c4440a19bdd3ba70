"""``memory``: the memory contract where the spec declares one (``max_memory_ratio=``,
``max_retained_bytes=``): peak bytes over forward + backward and bytes the graph keeps alive after
forward, measured by the core's storage tracker (:mod:`equiv.memory`).

Without a declared contract, a loose default: on the examples the costly checks run on
(``settings(costly_share=...)``; explicit ``examples=`` always) the bytes the implementation's graph
keeps alive after forward are measured (one more forward, no tracker); more than 1 MiB and more
than 8x the reference's is a finding (typically a saved small view of a huge storage)."""

from __future__ import annotations

from equiv.execution.record import Execution, Sink
from equiv._schedule import Schedule
from equiv.execution.contract_runs import measure, retained
from equiv.execution.script import Script, replay
from equiv.memory import memory_table

NAME = "memory"

#: the default sanity bound without a declared contract
DEFAULT_RATIO = 8
DEFAULT_MIN_BYTES = 1 << 20


def run(ex: Execution, sink: Sink) -> None:
    spec = ex.spec
    if spec.max_memory_ratio is None and spec.max_retained_bytes is None:
        _default(ex, sink)
        return
    impl = measure(ex, "impl")
    ref = measure(ex, "ref")
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


def _default(ex: Execution, sink: Sink) -> None:
    if not ex.costly:
        return
    impl = retained(ex, "impl")
    if impl is None or impl.retained_bytes <= DEFAULT_MIN_BYTES:
        return
    ref = retained(ex, "ref")
    if ref is None or impl.retained_bytes <= DEFAULT_RATIO * ref.retained_bytes:
        return
    top, top_bytes = impl.retained_by[0] if impl.retained_by else ("?", impl.retained_bytes)
    holders = "\n".join(f"  {b:>12,} B  {what}" for what, b in impl.retained_by[:5])
    events: tuple = ()
    script = Script(ex)
    if script.ok:  # the timeline of forward + backward: what is saved, and what it keeps alive
        _, events = replay(ex, Schedule(("forward", "backward")), ex.spec.impl,
                           script.cotangents(1), sink, script)
    sink.finding(
        NAME,
        f"the graph keeps {impl.retained_bytes:,} B alive after forward, "
        f"{impl.retained_bytes / max(ref.retained_bytes, 1):.0f}x the reference's "
        f"{ref.retained_bytes:,} B (the default bound: > {DEFAULT_RATIO}x and > 1 MiB).",
        argument=top,
        details=f"saved view keeps {top_bytes:,} bytes of storage alive: {top}\n"
                f"kept alive by (unique storages):\n{holders}",
        likely_cause=f"saved view keeps {top_bytes:,} bytes of storage alive ({top}).",
        fix="save a compact copy (.clone() of the small view) or recompute in backward; if the "
            "memory is intended, declare max_retained_bytes= (a declared contract replaces "
            "this default).", timeline=events,
    )
