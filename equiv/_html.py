"""The HTML report: one self-contained file (inline CSS and SVG, no script, no network).

Renders the JSON document of :mod:`equiv._results` (schema ``equiv.results/1``); it computes
nothing. Each finding with timeline events gets a picture: one lane per storage, one marker per
event (save, view, write, read, release), untracked writes (no version bump) marked in red, and
the optimizer/schedule ``step`` events as vertical rules.
"""

from __future__ import annotations

from html import escape as _html_escape
from typing import Any

from equiv._reports import visible

KINDS = ("save", "view", "write", "read", "release")
COLORS = {"save": "#1f6feb", "view": "#8250df", "write": "#d4a72c", "read": "#1a7f37",
          "release": "#6e7781", "untracked": "#cf222e"}
VERDICT_CLASS = {"pass": "pass", "fail": "fail", "skipped": "skipped",
                 "not-compiled": "notcompiled", "error": "error"}
LABELS = {"pass": "pass", "fail": "FAIL", "skipped": "skipped", "not-compiled": "not compiled",
          "error": "ERROR"}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px 32px;color:#1f2328}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 6px}
.meta{color:#59636e;margin:0 0 16px} code,pre{font:12.5px/1.4 ui-monospace,Menlo,Consolas,monospace}
table{border-collapse:collapse;margin:8px 0} th,td{border:1px solid #d1d9e0;padding:4px 10px;
text-align:left} th{background:#f6f8fa}
.verdict{font-weight:600} .pass{color:#1a7f37} .fail{color:#cf222e} .skipped{color:#6e7781}
.notcompiled{color:#9a6700} .error{color:#cf222e}
section.finding{border-top:2px solid #d1d9e0;margin-top:24px}
.facts{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:6px 0}
.facts dt{color:#59636e} .facts dd{margin:0}
pre.message{background:#f6f8fa;border:1px solid #d1d9e0;padding:10px;overflow-x:auto}
figure.timeline{margin:10px 0;border:1px solid #d1d9e0;padding:8px;overflow-x:auto;background:#fff}
figcaption{color:#59636e;font-size:12.5px;margin-top:4px}
.legend span{margin-right:14px;white-space:nowrap} .legend i{display:inline-block;width:10px;
height:10px;margin-right:4px;vertical-align:-1px}
.bar{height:12px;background:#54aeff;display:inline-block;vertical-align:-2px;margin-right:6px}
.empty{color:#59636e;font-style:italic;margin:4px 0}
h3{font-size:14px;margin:12px 0 4px} summary{cursor:pointer;color:#0969da;margin:8px 0}
"""


def escape(text: Any, quote: bool = True) -> str:
    """``text`` for HTML: scrubbed, control characters shown as escapes, markup escaped."""
    return _html_escape(visible(text), quote)


def render_html(doc: dict[str, Any]) -> str:
    """The whole report as one HTML string."""
    results = doc.get("results", [])
    counts = doc.get("summary", {})
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        "<title>equiv report</title>", f"<style>{CSS}</style></head><body>",
        "<h1>equiv report</h1>",
        '<p class="meta">' + escape(
            f"profile {doc.get('profile')} · seed {doc.get('seed')} · modes "
            f"{', '.join(doc.get('modes', []))} · devices {', '.join(doc.get('devices', []))} · "
            f"max_examples {doc.get('max_examples')} · {doc.get('tool')} · schema "
            f"{doc.get('schema')}") + "</p>",
        '<p class="meta">' + escape(", ".join(
            f"{n} {LABELS.get(v, v)}" for v, n in counts.items() if n)) + "</p>",
        "" if doc.get("complete", True) else '<p class="incomplete error" id="incomplete">'
        "INCOMPLETE: the run ended early; only the results that finished are shown.</p>",
        _summary_table(results),
    ]
    parts.extend(_findings(results))
    parts.append("</body></html>")
    return "\n".join(parts)


def _findings(results: list[dict[str, Any]]) -> list[str]:
    """Each root finding as a section, its follow-ons (``caused_by``) folded under it in a
    <details>; a follow-on whose root is not in the document stays a section of its own."""
    keys = {(ri, i) for ri, r in enumerate(results) for i in range(len(r.get("findings", [])))}
    under: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for ri, r in enumerate(results):
        for i, f in enumerate(r.get("findings", [])):
            c = f.get("caused_by")
            root = None if not isinstance(c, dict) else (
                ri if c.get("result") is None else c["result"], c.get("finding"))
            if root in keys and root != (ri, i):
                under.setdefault(root, []).append((ri, i))
    folded = {k for v in under.values() for k in v}
    parts, n = [], 0
    for ri, r in enumerate(results):
        for i, f in enumerate(r.get("findings", [])):
            if (ri, i) in folded:
                continue
            n += 1
            parts.append(_finding(n, r, f))
            mine = under.get((ri, i), [])
            if mine:
                labels = ", ".join(f"{results[a]['findings'][b].get('check')} "
                                   f"({results[a]['findings'][b].get('mode')})" for a, b in mine)
                parts.append(f'<details class="follow-ons"><summary>+{len(mine)} follow-on '
                             f"finding{'s' if len(mine) != 1 else ''}: {escape(labels)}"
                             "</summary>")
                for k, (a, b) in enumerate(mine, 1):
                    parts.append(_finding(f"{n}.{k}", results[a], results[a]["findings"][b]))
                parts.append("</details>")
    return parts


def _summary_table(results: list[dict[str, Any]]) -> str:
    rows = ['<table id="summary" class="summary"><thead><tr><th>spec</th><th>mode</th>'
            "<th>device</th><th>verdict</th><th>examples</th><th>findings</th></tr></thead>"
            "<tbody>"]
    for r in results:
        v = r.get("verdict", "")
        cls = VERDICT_CLASS.get(v, "")
        note = f'<br><small>{escape(r["reason"])}</small>' if r.get("reason") else ""
        rows.append(
            f"<tr><td><code>{escape(r.get('spec', ''))}</code></td><td>{escape(r.get('mode', ''))}"
            f"</td><td>{escape(r.get('device', ''))}</td><td class=\"verdict {cls}\">"
            f"{escape(LABELS.get(v, v))}{note}</td><td>{r.get('examples_run', 0)}</td>"
            f"<td>{len(r.get('findings', []))}</td></tr>")
    rows.append("</tbody></table>")
    return "".join(rows)


def _finding(n: int | str, r: dict[str, Any], f: dict[str, Any]) -> str:
    nums = f.get("numbers") or {}
    facts = [("spec", r.get("spec")), ("check", f.get("check")), ("mode", f.get("mode")),
             ("device", f.get("device")), ("dtype", f.get("dtype")),
             ("argument", f.get("argument")), ("greatest abs difference", nums.get("max_abs")),
             ("greatest rel difference", nums.get("max_rel")), ("at index", nums.get("index")),
             ("rtol / atol", None if nums.get("rtol") is None else
              f"{nums.get('rtol')} / {nums.get('atol')}"),
             ("example", (f.get("example") or {}).get("summary")),
             ("likely cause", f.get("likely_cause"))]
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in facts
                 if v not in (None, "", []))
    timeline = f.get("timeline") or []
    picture = (timeline_svg(timeline) if timeline else
               '<p class="empty">No timeline recorded for this finding.</p>')
    return (
        f'<section class="finding" id="finding-{n}"><h2>{n}. {escape(f.get("kind", ""))}: '
        f'{escape(f.get("headline", ""))}</h2><dl class="facts">{dl}</dl>'
        f"<h3>Timeline</h3>{picture}"
        f'<details><summary>Full message</summary><pre class="message">'
        f'{escape(f.get("message", ""))}</pre></details></section>')


def _bytes(v: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return str(v)  # pragma: no cover


def _describe(e: dict[str, Any]) -> str:
    kind = e.get("kind", "?")
    text = f"step {e.get('step')}" + (f" ({e['phase']})" if e.get("phase") else "") + f": {kind}"
    if e.get("op"):
        text += f" {e['op']}"
    if e.get("storage"):
        text += f" on {e['storage']}"
    if e.get("tensor"):
        text += f" ({e['tensor']})"
    if "version_before" in e or "version_after" in e:
        text += f", version {e.get('version_before')}→{e.get('version_after')}"
    if e.get("grad_fn"):
        text += f" by {e['grad_fn']}"
    if kind == "write" and e.get("tracked") is False:
        text += " — UNTRACKED: the version counter did not move, autograd cannot see it"
    if e.get("detail"):
        text += f"; {e['detail']}"
    return text


def timeline_svg(events: list[dict[str, Any]]) -> str:
    """A figure with one lane per storage; x is the event's step. Phases (forward, backward #k,
    release) are bands along the top; untracked writes and stale reads are marked in red."""
    storages: list[str] = []
    names: dict[str, list[str]] = {}
    saved: dict[str, int] = {}
    for e in events:
        s = e.get("storage")
        if e.get("kind") != "step" and s is not None:
            if s not in storages:
                storages.append(s)
                names[s] = []
            t = e.get("tensor")
            if t and t not in names[s]:
                names[s].append(t)
            if e.get("kind") == "save" and isinstance(e.get("nbytes"), int):
                saved[s] = max(saved.get(s, 0), e["nbytes"])
    steps = sorted({int(e.get("step", 0)) for e in events})
    col = {s: i for i, s in enumerate(steps)}
    dense = len(steps) > 24
    left, top, lane_h, col_w = 190, 50, 60, (58 if dense else 76)
    width = left + col_w * max(len(steps), 1) + 30
    height = top + lane_h * max(len(storages), 1) + 14
    out = [f'<figure class="timeline"><svg xmlns="http://www.w3.org/2000/svg" role="img" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'font-family="ui-monospace,Menlo,Consolas,monospace" font-size="12">',
           "<title>Timeline: one lane per storage</title>"]

    def x_of(step: Any) -> float:
        return left + col_w * col[int(step)] + col_w / 2

    out += _phase_bands(events, x_of, col_w)
    out.append(f'<text x="8" y="34" fill="#59636e">storage \\ step</text>')
    for st in steps:  # step numbers
        out.append(f'<text x="{x_of(st):.0f}" y="34" text-anchor="middle" fill="#59636e">'
                   f"{st}</text>")
    lanes_y = {s: top + lane_h * i + lane_h / 2 for i, s in enumerate(storages)}
    for i, s in enumerate(storages):  # lane backgrounds first, everything else on top
        y = lanes_y[s]
        out.append(f'<rect class="lane-bg" x="0" y="{y - lane_h / 2 + 2:.0f}" width="{width}" '
                   f'height="{lane_h - 4}" fill="{"#f6f8fa" if i % 2 == 0 else "#ffffff"}"/>')
    for e in events:
        if e.get("kind") == "step":
            x = x_of(e.get("step", 0))
            out.append(
                f'<g class="event step" data-kind="step" data-step="{e.get("step")}">'
                f"<title>{escape(_describe(e))}</title>"
                f'<line x1="{x:.0f}" y1="38" x2="{x:.0f}" y2="{height - 6}" stroke="#8c959f" '
                f'stroke-width="1.5" stroke-dasharray="5 3"/><text x="{x + 4:.0f}" y="48" '
                f'fill="#424a53" font-size="10">{escape(str(e.get("op") or "step"))}</text></g>')
    for s in storages:
        y = lanes_y[s]
        label = _clip(s + (f" ({', '.join(names[s])})" if names[s] else ""), 24)
        lane_events = [e for e in events if e.get("storage") == s and e.get("kind") != "step"]
        xs = [x_of(e.get("step", 0)) for e in lane_events]
        out.append(f'<g class="lane" data-storage="{escape(s)}">'
                   f'<title>{escape(s)}: {escape(", ".join(names[s]))}</title>'
                   f'<text class="lane-label" x="8" y="{y:.0f}" font-weight="600">'
                   f"{escape(label)}</text>")
        if s in saved:
            out.append(f'<text x="8" y="{y + 15:.0f}" font-size="10" fill="#59636e">'
                       f"saved: keeps {escape(_bytes(saved[s]))} alive</text>")
        if xs:
            out.append(f'<line x1="{min(xs):.0f}" y1="{y:.0f}" x2="{max(xs):.0f}" y2="{y:.0f}" '
                       'stroke="#afb8c1" stroke-width="2"/>')
        for e, x in zip(lane_events, xs):
            out.append(_marker(e, x, y, 9 if dense else 12))
        out.append("</g>")
    out.append("</svg>")
    out.append('<figcaption class="legend">' + "".join(
        f'<span><i style="background:{COLORS[k]}"></i>{k}</span>' for k in KINDS)
        + f'<span><i style="background:{COLORS["untracked"]}"></i>untracked write '
        "(no version bump)</span>"
        f'<span><i style="background:{COLORS["read"]};outline:2px solid '
        f'{COLORS["untracked"]}"></i>stale read (changed since saved)</span>'
        "<span>┆ optimizer step</span></figcaption></figure>")
    return "".join(out)


def _phase_bands(events: list[dict[str, Any]], x_of: Any, col_w: float) -> list[str]:
    """Bands along the top: consecutive steps of one phase share a band."""
    out: list[str] = []
    bands: list[list[Any]] = []
    for e in sorted(events, key=lambda e: int(e.get("step", 0))):
        phase = e.get("phase")
        if phase is None:
            continue
        if bands and bands[-1][0] == phase:
            bands[-1][2] = int(e.get("step", 0))
        else:
            bands.append([phase, int(e.get("step", 0)), int(e.get("step", 0))])
    for i, (phase, first, last) in enumerate(bands):
        x0, x1 = x_of(first) - col_w / 2 + 1, x_of(last) + col_w / 2 - 1
        out.append(f'<g class="phase" data-phase="{escape(str(phase))}">'
                   f'<rect x="{x0:.0f}" y="2" width="{x1 - x0:.0f}" height="16" rx="3" '
                   f'fill="{"#ddf4ff" if i % 2 == 0 else "#fff8c5"}"/>'
                   f'<text x="{(x0 + x1) / 2:.0f}" y="14" text-anchor="middle" font-size="11" '
                   f'fill="#1f2328">{escape(_clip(str(phase), int((x1 - x0) / 7)))}</text></g>')
    return out


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:max(n - 1, 1)] + "…"


def _marker(e: dict[str, Any], x: float, y: float, label_chars: int = 11) -> str:
    kind = e.get("kind", "?")
    untracked = kind == "write" and e.get("tracked") is False
    stale = kind == "read" and e.get("changed") is True
    color = COLORS["untracked"] if untracked else COLORS.get(kind, "#000")
    cls = (f"event {escape(str(kind))}" + (" untracked" if untracked else "")
           + (" stale" if stale else ""))
    attrs = (f'class="{cls}" data-kind="{escape(str(kind))}" data-step="{e.get("step")}" '
             f'data-storage="{escape(str(e.get("storage")))}"'
             + (f' data-tracked="{str(bool(e.get("tracked"))).lower()}"'
                if "tracked" in e else ""))
    r = 8
    if kind == "save":
        shape = f'<circle cx="{x:.0f}" cy="{y:.0f}" r="{r}" fill="{color}"/>'
    elif kind == "view":
        shape = (f'<polygon points="{x:.0f},{y - r - 1:.0f} {x + r + 1:.0f},{y:.0f} '
                 f'{x:.0f},{y + r + 1:.0f} {x - r - 1:.0f},{y:.0f}" fill="{color}"/>')
    elif kind == "write":
        shape = (f'<rect x="{x - r:.0f}" y="{y - r:.0f}" width="{2 * r}" height="{2 * r}" '
                 f'fill="{color}"' + (' stroke="#82071e" stroke-width="3"' if untracked else "")
                 + "/>")
    elif kind == "read":
        shape = (f'<polygon points="{x - r:.0f},{y - r:.0f} {x + r:.0f},{y - r:.0f} '
                 f'{x:.0f},{y + r:.0f}" fill="{color}"'
                 + (f' stroke="{COLORS["untracked"]}" stroke-width="3"' if stale else "") + "/>")
    elif kind == "release":
        shape = (f'<path d="M{x - r:.0f},{y - r:.0f} L{x + r:.0f},{y + r:.0f} M{x + r:.0f},'
                 f'{y - r:.0f} L{x - r:.0f},{y + r:.0f}" stroke="{color}" stroke-width="3"/>')
    else:
        shape = f'<circle cx="{x:.0f}" cy="{y:.0f}" r="4" fill="{color}"/>'
    label = escape(_clip(str(e.get("op") or e.get("grad_fn") or kind), label_chars))
    below = (f'<text x="{x:.0f}" y="{y + r + 13:.0f}" text-anchor="middle" font-size="10" '
             f'fill="#1f2328">{label}</text>')
    flag = ""
    if untracked or stale:
        flag = (f'<text class="{"untracked-label" if untracked else "stale-label"}" '
                f'x="{x:.0f}" y="{y - r - 5:.0f}" text-anchor="middle" font-size="10" '
                f'font-weight="700" fill="{COLORS["untracked"]}">'
                f'{"UNTRACKED" if untracked else "STALE"}</text>')
    return f"<g {attrs}><title>{escape(_describe(e))}</title>{shape}{below}{flag}</g>"
