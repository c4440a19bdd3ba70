"""The JSON report (schema equiv.results/1) and the HTML report, including a headless-Chromium
rendering of a stale-saved-value finding's timeline (skipped when no browser is installed)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from equiv._html import render_html
from equiv._results import SCHEMA, Result, document, finding_dict
from equiv.report import Finding, Report


@dataclasses.dataclass(frozen=True)
class TimelineFinding(Finding):
    """A Finding with its timeline events."""

    timeline: tuple = ()


@dataclasses.dataclass(frozen=True)
class Event:
    """An event given as a dataclass instead of a dict."""

    step: int
    kind: str
    storage: str
    tensor: str
    op: str


def ev(**fields) -> dict:
    """An event with every key of the recorder's schema (equiv/timeline.py), None by default."""
    base = dict.fromkeys(("step", "phase", "kind", "storage", "tensor", "op", "version_before",
                          "version_after", "tracked", "grad_fn", "detail"))
    return {**base, **fields}


#: the stale-saved-value hazard: w is saved, written through .data (no version bump), read
STALE = (
    ev(step=1, phase="forward", kind="save", storage="S1", tensor="x", grad_fn="MulBackward0",
       tracked=True, version_before=0, version_after=0, nbytes=4, shape=[1]),
    ev(step=2, phase="forward", kind="save", storage="S2", tensor="w", grad_fn="MulBackward0",
       tracked=True, version_before=0, version_after=0, nbytes=4096, shape=[1024]),
    ev(step=3, phase="forward", kind="view", storage="S2", tensor="detach(w)", op="detach",
       detail=".data or .detach(): own version counter"),
    ev(step=4, phase="forward", kind="write", storage="S2", tensor="detach(w)", op="add_",
       tracked=False, version_before=0, version_after=0, arg_bumped=False, saved_watched=[2],
       saved_bumped=[]),
    ev(step=5, phase="step", kind="step", op="sgd step"),
    ev(step=6, phase="backward #1", kind="read", storage="S2", tensor="w",
       grad_fn="MulBackward0", tracked=True, version_before=0, version_after=0, changed=True,
       saved_step=2, detail="content CHANGED since save (max |change| 0.5)"),
    ev(step=7, phase="backward #1", kind="read", storage="S1", tensor="x",
       grad_fn="MulBackward0", tracked=True, version_before=0, version_after=0, changed=False,
       saved_step=1, detail="content unchanged"),
    ev(step=8, phase="release", kind="release", storage="S1"),
    ev(step=9, phase="release", kind="release", storage="S2"),
)


def stale_finding(**extra) -> TimelineFinding:
    return TimelineFinding(
        check="gradients", headline="gradient w.r.t. 'x' differs from the reference on "
        "backward #1.", spec="k.scale_stale", implementation="k.scale_stale",
        reference="k.scale_ref", dtype="torch.float32", argument="x", max_abs=0.77,
        max_rel=0.32, index=(0,), rtol=1.3e-6, atol=1e-5,
        example="scale_stale(x=f32[1] cpu grad, w=f32[1] cpu grad)",
        likely_cause="saved tensor 'w' was written in place by add_ at step 3 without a "
        "version bump, before backward #1 read it at step 5.",
        timeline=STALE, **extra)


def make_doc(finding: Finding) -> dict:
    failed = Report(spec="k.scale_stale", implementation="k.scale_stale",
                    reference="k.scale_ref", findings=(finding,), seed=7, examples_run=3)
    ok = Report(spec="k.relu_", implementation="k.relu_", reference="k.relu_ref", seed=7,
                examples_run=30)
    results = [
        Result("k.relu_", "k.relu_", "k.relu_ref", "eager", "cpu", "pass", report=ok),
        Result("k.relu_", "k.relu_", "k.relu_ref", "eager", "cuda", "skipped", reason="no cuda"),
        Result("k.scale_stale", "k.scale_stale", "k.scale_ref", "eager", "cpu", "fail",
               report=failed),
    ]
    return document(results, tool="test", profile="default", seed=7, modes=["eager"],
                    devices=["cpu", "cuda"], max_examples=30)


# -- JSON -------------------------------------------------------------------------------------

def test_document_has_the_documented_top_level_fields():
    """The document carries its schema id, the run's parameters, counts and results."""
    doc = make_doc(stale_finding())
    assert doc["schema"] == SCHEMA == "equiv.results/1"
    assert set(doc) == {"schema", "complete", "equiv_version", "tool", "profile", "seed", "modes",
                        "devices", "max_examples", "reproduce", "summary", "results"}
    assert doc["complete"] is True
    assert doc["summary"] == {"pass": 1, "fail": 1, "skipped": 1, "not-compiled": 0, "error": 0}
    assert [r["verdict"] for r in doc["results"]] == ["pass", "skipped", "fail"]
    assert doc["results"][1]["reason"] == "no cuda"
    assert json.loads(json.dumps(doc)) == doc  # plain JSON, nothing lost


def test_finding_fields_numbers_example_and_timeline():
    """A finding has check, verdict-level data, numbers, example and its timeline events."""
    f = make_doc(stale_finding())["results"][2]["findings"][0]
    assert f["check"] == "gradients" and f["kind"] == "GradientMismatch"
    assert f["numbers"] == {"max_abs": 0.77, "max_rel": 0.32, "index": [0], "rtol": 1.3e-6,
                            "atol": 1e-5, "rule": None, "impl_error": None,
                            "baseline_error": None, "allowed": None, "k": None,
                            "rounding_level": None}
    assert f["example"]["summary"] == "scale_stale(x=f32[1] cpu grad, w=f32[1] cpu grad)"
    # a key the recorder left None is absent: the schema types each key, never null
    assert f["timeline"] == [{k: v for k, v in e.items() if v is not None} for e in STALE]
    assert f["message"].startswith("GradientMismatch: gradient w.r.t. 'x'")


def test_findings_without_timeline_or_compile_counts_are_tolerated():
    """A finding without a timeline, a result without compile counts: timeline [], None."""
    plain = Finding(check="forward", headline="output differs")
    f = finding_dict(plain)
    assert f["timeline"] == [] and "memory" not in f
    row = make_doc(plain)["results"][2]
    assert row["compile_counts"] is None


def test_dataclass_events_are_converted_to_dicts():
    """Timeline events given as dataclasses serialise like the dict form."""
    from equiv._results import _event

    assert _event(Event(1, "save", "S1", "w", "mul")) == {
        "step": 1, "kind": "save", "storage": "S1", "tensor": "w", "op": "mul"}


# -- HTML -------------------------------------------------------------------------------------

def test_html_is_self_contained():
    """No scripts, stylesheets, images or fonts are fetched: one file works offline."""
    html = render_html(make_doc(stale_finding()))
    for needle in ("<script", "<link", "src=", "url(", "@import", "<img"):
        assert needle not in html, needle
    assert html.startswith("<!DOCTYPE html>")


def test_html_has_summary_lanes_untracked_write_and_saved_bytes():
    """Summary rows, one lane per storage, the untracked write marked, saved bytes."""
    html = render_html(make_doc(stale_finding()))
    assert '<table id="summary"' in html and html.count("<tr><td><code>") == 3
    assert html.count('<g class="lane" data-storage="S1">') == 1
    assert html.count('<g class="lane" data-storage="S2">') == 1
    assert html.count('class="event write untracked"') == 1
    assert html.count('class="event read stale"') == 1  # the changed read; the other is fine
    assert html.count('class="event read"') == 1
    assert "UNTRACKED" in html and "STALE" in html
    assert [p for p in ("forward", "step", "backward #1", "release")
            if f'data-phase="{p}"' in html] == ["forward", "step", "backward #1", "release"]
    assert "saved: keeps 4.0 KiB alive" in html  # w's saved storage, from the save's nbytes


def test_html_without_timeline_says_so_and_escapes_text():
    """A finding without events says none was recorded; user text is escaped."""
    html = render_html(make_doc(Finding(check="forward", headline="<b>bold</b> & co")))
    assert "No timeline recorded for this finding." in html
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; co" in html and "<b>bold</b>" not in html


# -- in a real browser ------------------------------------------------------------------------

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(b)), None)


def _chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={profile}", "--window-size=1100,1000"]
    return subprocess.run([BROWSER, *flags, *args], capture_output=True, text=True,
                          timeout=120, check=True)


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into rows."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) *
                                                        (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, bpp, rows


@pytest.mark.skipif(BROWSER is None, reason="no headless browser installed (apt-get install "
                                            "chromium)")
def test_report_renders_in_headless_chromium_with_lanes_and_the_untracked_write(tmp_path):
    """Chromium loads the report: its DOM has both storage lanes and the untracked write, and
    the screenshot shows the untracked write's red marker."""
    page = tmp_path / "report.html"
    page.write_text(render_html(make_doc(stale_finding())), encoding="utf-8")
    dom = _chromium(["--dump-dom", page.as_uri()], tmp_path / "profile1").stdout
    assert '<table id="summary" class="summary">' in dom
    assert dom.count('class="lane" data-storage="S1"') == 1
    assert dom.count('class="lane" data-storage="S2"') == 1
    assert dom.count('class="event write untracked"') == 1
    assert dom.count('class="event read stale"') == 1
    assert 'data-phase="backward #1"' in dom
    assert 'data-kind="read"' in dom and 'data-kind="save"' in dom
    assert 'data-kind="release"' in dom and 'data-kind="view"' in dom

    # the screenshot: the untracked write's red marker is visible. Red is also used by the
    # FAIL verdict, so compare with the same report where the write was tracked.
    tracked = tuple(dict(e, tracked=True) if e["kind"] == "write" else e for e in STALE)
    twin = tmp_path / "tracked.html"
    twin.write_text(render_html(make_doc(stale_finding().__class__(
        **{**dataclasses.asdict(stale_finding()), "timeline": tracked}))), encoding="utf-8")
    red, blue = (0xCF, 0x22, 0x2E), (0x1F, 0x6F, 0xEB)  # untracked write, save marker
    counts = {}
    for name, html in (("untracked", page), ("tracked", twin)):
        shot = tmp_path / f"{name}.png"
        _chromium([f"--screenshot={shot}", html.as_uri()], tmp_path / f"profile-{name}")
        counts[name] = _count_colors(shot, (red, blue))
    assert counts["untracked"][blue] > 300, f"save markers not visible: {counts}"
    assert counts["untracked"][red] - counts["tracked"][red] > 150, (
        f"the untracked write is not drawn in red: {counts}")


def _count_colors(path: Path, colors: tuple) -> dict:
    import numpy as np

    width, bpp, rows = _png_pixels(path)
    pixels = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), width, bpp)
    rgb = pixels[..., :3].astype(np.int16)
    return {c: int((np.abs(rgb - np.array(c)) <= 12).all(-1).sum()) for c in colors}


@pytest.mark.skipif("timeline" not in {f.name for f in dataclasses.fields(Finding)},
                    reason="Finding has no timeline yet (the timeline recorder's issue)")
def test_a_real_stale_saved_value_finding_draws_its_recorded_timeline(tmp_path):
    """End to end: check() a kernel that overwrites its saved input through .data; the HTML
    of its gradient finding has the storage lane, the untracked write and the stale read."""
    import torch

    import equiv
    from equiv._results import run_one

    def square_ref(x):
        return x * x

    @equiv.equivalent_to(square_ref, examples=[(torch.tensor([1.0], requires_grad=True),)])
    def square_advance(x):
        y = x * x
        x.data.add_(1.0)
        return y

    result = run_one(square_advance.__equiv_spec__, "eager", "cpu", max_examples=3, seed=0)
    doc = document([result], tool="test", profile="default", seed=0, modes=["eager"],
                   devices=["cpu"], max_examples=3)
    grads = [f for f in doc["results"][0]["findings"] if f["check"] == "gradients"]
    assert grads and grads[0]["timeline"], "the gradient finding carries no timeline"
    html = render_html(doc)
    assert '<g class="lane" data-storage="S1">' in html
    assert 'class="event write untracked"' in html and 'class="event read stale"' in html
