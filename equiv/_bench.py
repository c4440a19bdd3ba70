"""``equiv bench`` and :func:`bench`: the implementation against its reference, timed.

For each size of a ladder (default about 1e3, 1e5 and 1e6 elements), one example drawn from
the spec's own strategy is scaled up: every tensor argument sharing the leading size of the
largest one is tiled along dim 0 (others, such as weights, stay as drawn), so the largest
argument has about that many elements. Equivalence is checked first on those very examples
(a quick check: error parity, forward, mutation, gradients, eager); a spec that fails is
reported and nothing is timed. Then each side is timed, forward (under ``no_grad``) and
forward + backward (one VJP with a fixed cotangent), mutated arguments cloned before every
call on both sides: on CUDA with events around synchronised calls, on CPU with
``torch.utils.benchmark.Timer.blocked_autorange`` (median and interquartile range). Peak
memory per side is :func:`equiv.memory.measure` over forward + backward: the CUDA
allocator's peak, or on CPU the peak live bytes of the storages created during the call
(a dispatch-mode storage tracker; the inputs are not counted).
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
from typing import Any, Callable, Sequence

import torch

from equiv._args import Args, as_args
from equiv._compat import tree_flatten
from equiv.errors import InvalidArgument
from equiv.examples import Template
from equiv.memory import measure
from equiv.spec import Spec, get_spec

#: the default ladder: elements of the largest tensor argument
DEFAULT_SIZES: tuple[int, ...] = (1_000, 100_000, 1_000_000)
#: the checks of the quick equivalence check that precedes timing
QUICK_CHECKS = ("error-parity", "forward", "mutation", "gradients")


@dataclasses.dataclass(frozen=True)
class Timing:
    """One side, one pass: median and interquartile range in milliseconds."""

    median_ms: float
    iqr_ms: float


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One size of one spec. ``speedup`` = reference time / implementation time (forward;
    ``speedup_fwd_bwd`` for forward + backward, None when nothing is differentiated)."""

    size: int
    impl: Timing
    ref: Timing
    impl_fwd_bwd: Timing | None
    ref_fwd_bwd: Timing | None
    impl_peak_bytes: int | None
    ref_peak_bytes: int | None

    @property
    def speedup(self) -> float:
        return self.ref.median_ms / max(self.impl.median_ms, 1e-12)

    @property
    def speedup_fwd_bwd(self) -> float | None:
        if self.impl_fwd_bwd is None or self.ref_fwd_bwd is None:
            return None
        return self.ref_fwd_bwd.median_ms / max(self.impl_fwd_bwd.median_ms, 1e-12)


@dataclasses.dataclass
class BenchResult:
    """One spec's bench: ``equivalent`` False (with ``reason``: the quick check's first
    finding, or why the examples could not be scaled) means nothing was timed."""

    spec: str
    device: str
    equivalent: bool
    reason: str = ""
    rows: list[BenchRow] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (docs/bench.md lists the fields)."""
        return {"spec": self.spec, "device": self.device, "equivalent": self.equivalent,
                "reason": self.reason, "sizes": [_row_dict(r) for r in self.rows]}


def _row_dict(r: BenchRow) -> dict[str, Any]:
    def t(x: Timing | None, what: str) -> float | None:
        return None if x is None else getattr(x, what)

    return {"size": r.size, "impl_ms": r.impl.median_ms, "ref_ms": r.ref.median_ms,
            "impl_iqr_ms": r.impl.iqr_ms, "ref_iqr_ms": r.ref.iqr_ms, "speedup": r.speedup,
            "impl_fwd_bwd_ms": t(r.impl_fwd_bwd, "median_ms"),
            "ref_fwd_bwd_ms": t(r.ref_fwd_bwd, "median_ms"),
            "speedup_fwd_bwd": r.speedup_fwd_bwd,
            "impl_peak_bytes": r.impl_peak_bytes, "ref_peak_bytes": r.ref_peak_bytes}


def bench(impl: Any, *, sizes: Sequence[int] | None = None, device: str = "cpu",
          min_time: float = 0.2) -> BenchResult:
    """Time ``impl`` (an implementation with a spec, or a :class:`~equiv.Spec`) against its
    reference at each size (elements of the largest tensor argument; default
    :data:`DEFAULT_SIZES`), after a quick equivalence check on the same examples;
    ``min_time``: seconds each measurement runs at least (docs/bench.md)."""
    spec = get_spec(impl)
    ladder = _sizes(sizes)
    if isinstance(min_time, bool) or not isinstance(min_time, (int, float)) or min_time <= 0:
        raise InvalidArgument(f"bench(min_time={min_time!r}): give seconds > 0, e.g. 0.2.")
    examples = _ladder(spec, ladder)
    rejected = _rejected(spec, examples, device)
    if rejected is not None:
        return BenchResult(spec.name, device, False, rejected)
    why = _not_equivalent(spec, [a for _, a in examples], device)
    if why is not None:
        return BenchResult(spec.name, device, False, why)
    result = BenchResult(spec.name, device, True)
    for size, args in examples:
        result.rows.append(_measure_size(spec, args, size, device, float(min_time)))
    return result


def _sizes(sizes: Sequence[int] | None) -> tuple[int, ...]:
    if sizes is None:
        return DEFAULT_SIZES
    try:
        ladder = tuple(int(s) for s in sizes)
    except (TypeError, ValueError):
        ladder = ()
    if not ladder or any(s < 1 for s in ladder) or any(
            isinstance(s, bool) or float(s) != int(s) for s in sizes):
        raise InvalidArgument(
            f"bench(sizes={sizes!r}): give element counts >= 1, e.g. (1000, 100000).")
    return tuple(sorted(set(ladder)))


# -- the examples -----------------------------------------------------------------------------
def _ladder(spec: Spec, sizes: tuple[int, ...]) -> list[tuple[int, Args]]:
    """(size, example) for each size: the drawn example scaled (sizes it cannot reach merge)."""
    base = _drawn(spec)
    out: dict[int, Args] = {}
    for target in sizes:
        args = _scaled(base, target)
        out.setdefault(_largest(args), args)
    return sorted(out.items(), key=lambda kv: kv[0])


def _rejected(spec: Spec, examples: list[tuple[int, Args]], device: str) -> str | None:
    """Why the scaled examples cannot be benched: the reference raised on one (the scaling
    broke a shape constraint of the spec, not a finding), else None."""
    from equiv.execution.calls import call

    for size, args in examples:
        side = Template(spec.signature, args, spec.mutates.keys()).instantiate(device=device)
        _, exc = call(spec.ref, side)
        if exc is not None:
            shapes = ", ".join(str(tuple(t.shape)) for t in _tensors(args))
            return (f"could not scale: the reference raised {type(exc).__name__} on the example "
                    f"scaled to {size} elements (tensor shapes {shapes}); give examples= with "
                    "a leading batch dimension to tile")
    return None


def _tensors(args: Args) -> list[torch.Tensor]:
    return [t for t in tree_flatten((args.args, args.kwargs))[0] if isinstance(t, torch.Tensor)]


def _largest(args: Args) -> int:
    return max((t.numel() for t in _tensors(args)), default=0)


def _drawn(spec: Spec) -> Args:
    """The spec's first explicit example, else the smallest non-empty one of a few drawn from
    its strategy (derandomized: the same every run; derived inputs in float32, away from the
    reference's kinks, as the runner draws them)."""
    if spec.examples:
        return as_args(spec.examples[0])
    import hypothesis

    from equiv.strategies import arguments_for

    strategy = spec.inputs if not spec.derived_inputs else arguments_for(
        spec.signature, dtypes_=[torch.float32], reference=spec.ref, mutated=spec.mutates)

    seen: list[Args] = []

    @hypothesis.settings(database=None, derandomize=True, max_examples=10, deadline=None,
                         phases=[hypothesis.Phase.generate],
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(strategy)
    def draw(example: Any) -> None:
        seen.append(as_args(example))

    draw()
    seen = [a for a in seen if _largest(a) > 0]
    if not seen:
        raise InvalidArgument(f"bench({spec.name}): its inputs= drew no tensor with elements "
                              "to scale; give examples= or inputs= drawing non-empty tensors.")
    batched = [a for a in seen if _biggest(a).dim() > 1 and _biggest(a).shape[0] > 1] or [
        a for a in seen if _biggest(a).dim() and _biggest(a).shape[0] > 1]
    return min(batched or seen, key=_largest)


def _biggest(args: Args) -> torch.Tensor:
    return max(_tensors(args), key=lambda t: t.numel())


def _scaled(args: Args, target: int) -> Args:
    """``args`` with every tensor of the largest one's dims and leading size tiled along
    dim 0 so that the largest has about ``target`` elements (at least the drawn size)."""
    big = _biggest(args)
    if big.dim() == 0:
        return args
    lead, k = big.shape[0], max(1, round(target / max(big.numel(), 1)))

    def tile(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() != big.dim() or v.shape[0] != lead \
                or k == 1:
            return v
        return v.detach().repeat(k, *([1] * (v.dim() - 1))).requires_grad_(v.requires_grad)

    return Args(*[_tree(tile, a) for a in args.args],
                **{n: _tree(tile, a) for n, a in args.kwargs.items()})


def _tree(fn: Callable[[Any], Any], value: Any) -> Any:
    from equiv._compat import tree_unflatten

    flat, spec = tree_flatten(value)
    return tree_unflatten([fn(v) for v in flat], spec)


def _not_equivalent(spec: Spec, examples: list[Args], device: str) -> str | None:
    """The first finding of the quick check on ``examples`` (eager), or None when it passes."""
    import hypothesis

    from equiv._settings import settings as Settings
    from equiv.run import check

    quick = dataclasses.replace(spec, examples=tuple(examples), settings=None)
    cfg = Settings(max_examples=1, modes=("eager",), devices=(device,), checks=QUICK_CHECKS,
                   derandomize=True, hypothesis_settings=hypothesis.settings(database=None))
    report = check(quick, settings=cfg, raise_on_failure=False)
    if report.ok:
        return None
    if report.findings:
        f = report.findings[0]
        return f"not equivalent ({f.check}): {f.headline}"
    return "not equivalent: nothing could be checked"


# -- timing -----------------------------------------------------------------------------------
def _measure_size(spec: Spec, args: Args, size: int, device: str, min_time: float) -> BenchRow:
    template = Template(spec.signature, args, spec.mutates.keys())
    timed: dict[str, tuple[Timing, Timing | None, int | None]] = {}
    for which, fn in (("impl", spec.impl), ("ref", spec.ref)):
        fwd, fwd_bwd = _passes(spec, template, fn, device)
        stats = measure(fn, template.instantiate(device=device))
        timed[which] = (_time(fwd, device, min_time),
                        None if fwd_bwd is None else _time(fwd_bwd, device, min_time),
                        None if stats is None else stats.peak_bytes)
    (i_f, i_b, i_p), (r_f, r_b, r_p) = timed["impl"], timed["ref"]
    return BenchRow(size, i_f, r_f, i_b if r_b is not None else None,
                    r_b if i_b is not None else None, i_p, r_p)


def _passes(spec: Spec, template: Template, fn: Callable[..., Any], device: str,
            ) -> tuple[Callable[[], None], Callable[[], None] | None]:
    """The forward and forward + backward callables of ``fn`` on one copy of the example
    (mutated arguments cloned before each call); the second None when nothing is
    differentiated."""
    side = template.instantiate(device=device)
    mutated = set(spec.mutates)
    leaves = [leaf for leaf in side.leaves if leaf is not None]

    def bound() -> inspect.BoundArguments:
        args = {n: (_tree(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, v)
                    if n in mutated else v) for n, v in side.bound.arguments.items()}
        return inspect.BoundArguments(spec.signature, args)  # type: ignore[arg-type]

    def forward() -> None:
        with torch.no_grad():
            b = bound()
            fn(*b.args, **b.kwargs)

    def differentiated() -> list[torch.Tensor]:
        b = bound()
        out = fn(*b.args, **b.kwargs)
        values = tree_flatten(out)[0] + [b.arguments[n] for n in mutated]
        return [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)
                and v.requires_grad and v.dtype.is_floating_point]

    outs = differentiated() if leaves else []
    if not outs:
        return forward, None
    cots = [torch.ones_like(o) for o in outs]

    def forward_backward() -> None:
        torch.autograd.grad(differentiated(), leaves, cots, allow_unused=True)

    return forward, forward_backward


def _time(fn: Callable[[], None], device: str, min_time: float) -> Timing:
    if torch.device(device).type == "cuda":  # pragma: no cover - CUDA machines only
        return _time_cuda(fn, min_time)
    for _ in range(3):  # warm-up: caches, allocator, lazy initialisation
        fn()
    from torch.utils.benchmark import Timer

    m = Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_time)
    return Timing(m.median * 1e3, m.iqr * 1e3)


def _time_cuda(fn: Callable[[], None], min_time: float) -> Timing:  # pragma: no cover
    """CUDA events around each synchronised call: warm-up, then calls until ``min_time``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    while sum(times) < min_time * 1e3 or len(times) < 5:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    q = statistics.quantiles(times, n=4)
    return Timing(statistics.median(times), q[2] - q[0])


# -- the table, JSON and HTML ------------------------------------------------------------------
HEADER = ("spec", "size", "impl ms", "ref ms", "speedup", "impl+bwd ms", "ref+bwd ms",
          "speedup+bwd", "impl peak", "ref peak")


def table(results: list[BenchResult]) -> str:
    """The plain-text table, one line per (spec, size); a failing spec says so instead."""
    lines = [HEADER]
    for r in results:
        if not r.equivalent:
            lines.append((r.spec, "-", "not timed:", r.reason[:100], "", "", "", "", "", ""))
            continue
        for row in r.rows:
            d = _row_dict(row)
            lines.append((r.spec, f"{row.size:.0e}" if row.size >= 1e4 else str(row.size),
                          _ms(d["impl_ms"]), _ms(d["ref_ms"]), f"{row.speedup:.2f}x",
                          _ms(d["impl_fwd_bwd_ms"]), _ms(d["ref_fwd_bwd_ms"]),
                          "-" if row.speedup_fwd_bwd is None else f"{row.speedup_fwd_bwd:.2f}x",
                          _mem(row.impl_peak_bytes), _mem(row.ref_peak_bytes)))
    widths = [max(len(str(line[i])) for line in lines if line[2] != "not timed:" or i < 2)
              for i in range(len(HEADER))]
    out = []
    for line in lines:
        if line[2] == "not timed:":
            said = "not timed" if line[3].startswith("could not") else "not equivalent, not timed"
            out.append(f"{line[0]:<{widths[0]}}  {said}: {line[3]}")
        else:
            out.append("  ".join(f"{str(c):<{w}}" for c, w in zip(line, widths)).rstrip())
    return "\n".join(out)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _mem(v: int | None) -> str:
    if v is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{v} B"


def document(results: list[BenchResult]) -> dict[str, Any]:
    """The ``--json`` document (docs/bench.md)."""
    return {"equiv_bench": 1, "torch": torch.__version__,
            "results": [r.as_dict() for r in results]}


def render_html(doc: dict[str, Any]) -> str:
    """A self-contained page: per spec, the table and inline SVG plots of time and peak
    memory against size (no script)."""
    import html

    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>equiv bench</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
             "svg{margin:8px 16px 8px 0;background:#fafafa}</style></head><body>",
             f"<h1>equiv bench</h1><p>torch {html.escape(doc['torch'])}</p>"]
    for r in doc["results"]:
        parts.append(f"<h2 class='spec'>{html.escape(r['spec'])} ({html.escape(r['device'])})"
                     "</h2>")
        if not r["equivalent"]:
            parts.append(f"<p class='failed'>not timed: {html.escape(r['reason'])}</p>")
            continue
        keys = ("size", "impl_ms", "ref_ms", "speedup", "impl_fwd_bwd_ms", "ref_fwd_bwd_ms",
                "speedup_fwd_bwd", "impl_peak_bytes", "ref_peak_bytes")
        parts.append("<table><tr>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr>")
        for row in r["sizes"]:
            parts.append("<tr>" + "".join(f"<td>{_cell(row[k])}</td>" for k in keys) + "</tr>")
        parts.append("</table>")
        parts.append(_plot(r["sizes"], [("impl", "impl_ms", "#c0392b"),
                                        ("ref", "ref_ms", "#2471a3"),
                                        ("impl+bwd", "impl_fwd_bwd_ms", "#e59866"),
                                        ("ref+bwd", "ref_fwd_bwd_ms", "#85c1e9")], "time (ms)"))
        parts.append(_plot(r["sizes"], [("impl", "impl_peak_bytes", "#c0392b"),
                                        ("ref", "ref_peak_bytes", "#2471a3")], "peak bytes"))
    parts.append("</body></html>")
    return "\n".join(parts)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _plot(rows: list[dict[str, Any]], series: list[tuple[str, str, str]], label: str) -> str:
    """A log-log line plot of ``series`` against size, as inline SVG."""
    import math

    w, h, pad = 360, 220, 44
    pts = [(row["size"], row[k]) for row in rows for _, k, _ in series
           if row[k] is not None and row[k] > 0]
    if not pts:
        return ""
    xs = [math.log10(p[0]) for p in pts]
    ys = [math.log10(p[1]) for p in pts]
    x0, x1 = min(xs), max(xs) + (1e-9 if max(xs) == min(xs) else 0)
    y0, y1 = min(ys), max(ys) + (1e-9 if max(ys) == min(ys) else 0)

    def xy(size: float, value: float) -> str:
        x = pad + (math.log10(size) - x0) / (x1 - x0 or 1) * (w - 2 * pad)
        y = h - pad - (math.log10(value) - y0) / (y1 - y0 or 1) * (h - 2 * pad)
        return f"{x:.1f},{y:.1f}"

    out = [f"<svg class='plot' width='{w}' height='{h}' viewBox='0 0 {w} {h}' "
           f"xmlns='http://www.w3.org/2000/svg' role='img' aria-label='{label} against size'>",
           f"<text x='{w / 2}' y='14' text-anchor='middle' font-size='12'>{label} against "
           "size (log-log)</text>",
           f"<line x1='{pad}' y1='{h - pad}' x2='{w - pad}' y2='{h - pad}' stroke='#888'/>",
           f"<line x1='{pad}' y1='{pad}' x2='{pad}' y2='{h - pad}' stroke='#888'/>"]
    for n, (name, key, color) in enumerate(series):
        line = [xy(row["size"], row[key]) for row in rows if row[key] is not None and row[key] > 0]
        if line:
            out.append(f"<polyline class='series' fill='none' stroke='{color}' stroke-width='2' "
                       f"points='{' '.join(line)}'/>")
            out += [f"<circle cx='{p.split(',')[0]}' cy='{p.split(',')[1]}' r='3' "
                    f"fill='{color}'/>" for p in line]
            out.append(f"<text x='{w - pad + 2}' y='{pad + 14 * n}' font-size='10' "
                       f"fill='{color}'>{name}</text>")
    for row in rows:
        x = xy(row["size"], 10 ** y0).split(",")[0]
        out.append(f"<text x='{x}' y='{h - pad + 14}' font-size='10' text-anchor='middle'>"
                   f"{row['size']:.0e}</text>")
    out.append("</svg>")
    return "".join(out)


def main(specs: list[Spec], *, sizes: Sequence[int] | None, device: str, min_time: float,
         json_path: str | None, html_path: str | None, out: Any, err: Any) -> int:
    """``equiv bench``: every spec benched, the table printed, the files written; 0 when
    every spec was equivalent and timed, 1 when one was not (or could not be scaled)."""
    import json

    results = []
    for spec in specs:
        print(f"equiv bench: {spec.name} ...", file=err, flush=True)
        results.append(bench(spec, sizes=sizes, device=device, min_time=min_time))
    print(table(results), file=out)
    doc = document(results)
    try:
        if json_path:
            with open(json_path, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2)
        if html_path:
            with open(html_path, "w", encoding="utf-8") as fh:
                fh.write(render_html(doc))
    except OSError as e:
        print(f"equiv: could not write a bench file: {e}", file=err)
        return 2
    return 0 if all(r.equivalent for r in results) else 1
