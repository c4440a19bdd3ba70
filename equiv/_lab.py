"""The function lab (``docs/lab/index.html``, ``equiv lab``): its autograd panel's data.

The lab page has two panels. The function panel is pure JavaScript: f(x) = a·x² and its slope
2·a·x, evaluated afresh for each (a, x) the reader picks. The autograd panel shows what happens
when ONE forward input saved for backward is overwritten: x=1 is saved at forward, x:=2 is
written, backward reads it. Its data comes from :func:`record`, which runs the two x² lab kernels
of ``examples/`` for real under equiv's timeline recorder:

- ``tracked``: ``examples/x_squared_lab.py`` (``ctx.save_for_backward``), then x advanced with a
  tracked in-place write, as equiv's ``mutate-after-forward`` schedule does: autograd raises;
- ``untracked``: ``examples/failing/x_squared_advance.py`` (x advanced through ``.data``):
  backward silently returns slope 4 where 2 is due, and equiv's finding says why.

The kernels are repeated here (the examples are not part of the installed package);
``tests/test_lab.py`` checks that the example files record the same timelines. The page template
is ``equiv/lab.html``; :func:`build_page` puts the JSON between its markers. Regenerate the
committed page with ``python -m equiv._lab`` (a test fails when it drifts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

import equiv
from equiv.timeline import Recorder, likely_cause, render

__all__ = ["record", "lab_json", "build_page", "TEMPLATE", "BEGIN", "END"]

TEMPLATE = Path(__file__).with_name("lab.html")
BEGIN = '<script id="lab-data" type="application/json">'
END = "</script><!-- /lab-data -->"


# -- the two kernels, as in examples/x_squared_lab.py and examples/failing/x_squared_advance.py --
def square_ref(x):
    return x * x


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)  # versioned: a later write to x is detected
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@equiv.equivalent_to(square_ref, examples=[(torch.tensor([1.0], requires_grad=True),)])
def square(x):
    return _Square.apply(x)


@equiv.equivalent_to(square_ref, examples=[(torch.tensor([1.0], requires_grad=True),)])
def square_advance(x):
    y = x * x  # saves x for backward (slope 2x)
    x.data.add_(1.0)  # advance the lab to the next x, behind autograd's back
    return y


def _advance_tracked(x: torch.Tensor) -> None:
    with torch.no_grad():
        x.add_(1.0)  # bumps x's version counter


def _run(kernel: Callable, advance: Callable | None, x: torch.Tensor,
         rec: Recorder | None) -> dict[str, Any]:
    """x=1 -> kernel -> (advance) -> backward; recorded by ``rec`` when given."""
    out: dict[str, Any] = {}
    if rec is not None:
        rec.name(x, "x")
    y = kernel(x)
    out["y"] = y.item()
    if rec is not None:
        rec.name(y, "y")
        rec.after_forward([y])
        rec.phase("after forward")
    if advance is not None:
        advance(x)
    out["x_at_backward"] = x.item()
    if rec is not None:
        rec.phase("backward #1")
    try:
        (slope,) = torch.autograd.grad(y, x)
        out["slope"], out["error"] = slope.item(), None
    except RuntimeError as e:
        out["slope"], out["error"] = None, str(e)
    if rec is not None:
        rec.phase("release")
    return out


def _case(kernel: Callable, advance: Callable | None) -> dict[str, Any]:
    # Outcome without the recorder: its saved-tensor hooks switch autograd's version check off.
    plain = _run(kernel, advance, torch.tensor([1.0], requires_grad=True), None)
    # x is made outside the recorder (its creation is not the story) and dropped inside it, so
    # the timeline ends with its storage being freed
    xs = [torch.tensor([1.0], requires_grad=True)]
    rec = Recorder()
    with rec:
        _run(kernel, advance, xs.pop(), rec)
    events = [dict(e) for e in rec.events]
    return {"x_at_forward": 1.0, **plain, "slope_due": 2.0, "events": events,
            "text": render(events), "likely_cause": likely_cause(events)}


def record(square_kernel: Callable | None = None,
           advance_kernel: Callable | None = None) -> dict[str, Any]:
    """Run both cases for real and return the lab's data (plain, deterministic JSON values)."""
    square_kernel = square_kernel or square
    advance_kernel = advance_kernel or square_advance
    tracked = _case(square_kernel, _advance_tracked)
    tracked["code"] = ("y = square(x)            # Square.apply: ctx.save_for_backward(x)\n"
                       "with torch.no_grad():\n"
                       "    x.add_(1.0)          # x := 2, tracked: version 0 -> 1\n"
                       "torch.autograd.grad(y, x)")
    untracked = _case(advance_kernel, None)
    untracked["code"] = ("def square_advance(x):\n"
                         "    y = x * x            # saves x for backward (slope 2x)\n"
                         "    x.data.add_(1.0)     # x := 2 through .data: no version bump\n"
                         "    return y\n"
                         "torch.autograd.grad(square_advance(x), x)")
    report = equiv.check(advance_kernel, max_examples=5, seed=0, modes=("eager",),
                         devices=("cpu",), raise_on_failure=False)
    grads = [f for f in report.findings if f.check == "gradients"]
    finding = grads[0] if grads else None
    return {
        "torch": torch.__version__.split("+")[0],
        "tracked": tracked,
        "untracked": untracked,
        "finding": None if finding is None else {
            "kind": finding.kind, "check": finding.check, "headline": finding.headline,
            "likely_cause": finding.likely_cause,
            "command": "equiv.check(square_advance, max_examples=5, seed=0)"},
    }


def lab_json(data: dict[str, Any] | None = None) -> str:
    """The JSON embedded in the page: sorted keys, one line, safe inside a <script> element."""
    text = json.dumps(record() if data is None else data, sort_keys=True, ensure_ascii=True,
                      separators=(",", ":"))
    return text.replace("</", "<\\/")


def embedded_json(page: str) -> str:
    """The JSON text between the markers of ``page``."""
    m = re.search(re.escape(BEGIN) + "(.*?)" + re.escape(END), page, re.S)
    if m is None:
        raise ValueError("the page has no lab-data markers")
    return m.group(1)


def build_page(data: dict[str, Any] | None = None, template: str | None = None) -> str:
    """The self-contained lab page with ``data`` (default: a fresh :func:`record`) embedded."""
    page = TEMPLATE.read_text(encoding="utf-8") if template is None else template
    start = page.index(BEGIN) + len(BEGIN)
    stop = page.index(END, start)
    return page[:start] + lab_json(data) + page[stop:]


def write_page(path: str | Path, data: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(build_page(data), encoding="utf-8")
    return path


if __name__ == "__main__":  # regenerate the committed page: python -m equiv._lab
    target = Path(__file__).resolve().parent.parent / "docs" / "lab" / "index.html"
    print(write_page(target))
