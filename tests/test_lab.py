"""The function lab (docs/lab/index.html, equiv lab): its autograd panel is recorded from a real
run and cannot drift from the committed page; in headless Chromium, driven over the DevTools
protocol with real mouse and keyboard input, the seed's exercise gives slopes 2 then 4, edits
keep t, Reset zeroes it, and the autograd panel shows the untracked write and the stale slope 4.
The browser test skips when no Chromium is installed."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import select
import shutil
import signal
import time
from pathlib import Path

import pytest

import equiv._lab as lab
from equiv.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "lab" / "index.html"


@pytest.fixture(scope="module")
def fresh() -> dict:
    return lab.record()


def assert_page_in_sync(page: str, data: dict) -> None:
    """The committed page embeds exactly the JSON a fresh recording gives, in the template."""
    assert lab.embedded_json(page) == lab.lab_json(data), (
        "docs/lab/index.html embeds stale lab JSON: regenerate it with python -m equiv._lab")
    assert page == lab.build_page(data), (
        "docs/lab/index.html differs from equiv/lab.html + fresh JSON: python -m equiv._lab")


# -- the recording ------------------------------------------------------------------------------

def test_the_recording_is_a_real_run_save_write_read(fresh):
    """Tracked: autograd raises its version error. Untracked: slope 4 where 2 is due. Both
    timelines save x=1, write x := 2, then read in backward; only the .data write is untracked."""
    t, u = fresh["tracked"], fresh["untracked"]
    assert t["slope"] is None and "modified by an inplace operation" in t["error"]
    assert "is at version 1; expected version 0" in t["error"]
    assert u["error"] is None and u["slope"] == 4.0 and u["slope_due"] == 2.0
    assert t["y"] == u["y"] == 1.0 and t["x_at_backward"] == u["x_at_backward"] == 2.0
    for case, tracked in ((t, True), (u, False)):
        kinds = [e["kind"] for e in case["events"]]
        assert kinds.index("save") < kinds.index("write") < kinds.index("read")
        (write,) = [e for e in case["events"] if e["kind"] == "write"]
        assert write["tracked"] is tracked and write["op"] == "add_"
        assert all(e["changed"] for e in case["events"] if e["kind"] == "read")
    assert [e["tensor"] for e in u["events"] if e["kind"] == "write"] == ["detach(x)"]
    f = fresh["finding"]
    assert f["check"] == "gradients"
    assert "overwritten by add_ via .data" in f["likely_cause"]
    assert "version NOT bumped: untracked write" in f["likely_cause"]


def test_the_recording_is_deterministic_json(fresh):
    """Plain JSON values, the same text on a second run (so the drift check is meaningful)."""
    text = lab.lab_json(fresh)
    assert json.loads(text) == json.loads(json.dumps(fresh))
    assert lab.lab_json(lab.record()) == text
    assert "</" not in text  # safe inside <script>


def test_the_example_files_record_the_same_lab(fresh):
    """equiv/_lab.py repeats the kernels of examples/: the example files give the same data."""
    def load(rel: str):
        spec = importlib.util.spec_from_file_location(f"lab_{Path(rel).stem}", ROOT / rel)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    good = load("examples/x_squared_lab.py")
    bad = load("examples/failing/x_squared_advance.py")
    assert lab.record(good.square, bad.square_advance) == fresh


# -- the committed page -------------------------------------------------------------------------

def test_the_committed_page_matches_a_fresh_recording(fresh):
    assert_page_in_sync(PAGE.read_text(encoding="utf-8"), fresh)


def test_the_drift_check_fails_when_the_json_or_the_template_changes(fresh):
    """A page whose embedded slope differs, or whose template was edited by hand, is caught."""
    page = PAGE.read_text(encoding="utf-8")
    stale = dict(fresh, untracked=dict(fresh["untracked"], slope=2.0))
    with pytest.raises(AssertionError, match="stale lab JSON"):
        assert_page_in_sync(lab.build_page(stale), fresh)
    with pytest.raises(AssertionError, match="differs from equiv/lab.html"):
        assert_page_in_sync(page.replace("The function lab</h1>", "The lab</h1>"), fresh)


def test_the_page_is_self_contained():
    """No network: nothing is fetched (no src=, <link>, url(), http)."""
    page = PAGE.read_text(encoding="utf-8").replace('"http://www.w3.org/2000/svg"', "SVG_NS")
    for needle in ("src=", "<link", "url(", "@import", "http://", "https://", "<img"):
        assert needle not in page, needle


# -- the CLI ------------------------------------------------------------------------------------

def test_equiv_lab_writes_the_page_and_opens_nothing_unless_asked(tmp_path, monkeypatch, capsys):
    opened = []
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    out = tmp_path / "sub" / "lab.html"
    assert main(["lab", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == PAGE.read_text(encoding="utf-8")
    assert opened == [] and str(out) in capsys.readouterr().out
    assert main(["lab", "--out", str(out), "--open"]) == 0
    assert opened == [out.resolve().as_uri()]


def test_equiv_lab_reports_an_unwritable_path(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["lab", "--out", str(blocker / "lab.html")]) == 2
    assert "could not write" in capsys.readouterr().err


# -- in a real browser --------------------------------------------------------------------------

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(b)), None)


class DevTools:
    """Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON
    messages separated by NUL on fds 3 and 4), so no websocket library is needed."""

    def __init__(self, profile: Path) -> None:
        import fcntl  # POSIX only, like the pipe protocol itself

        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        # fds 3 and 4 in the browser; move ours above them first so the dup2s cannot clash
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_chrome_r, from_chrome_w)]
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        actions = [(os.POSIX_SPAWN_DUP2, ends[0], 3), (os.POSIX_SPAWN_DUP2, ends[1], 4),
                   (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)]
        self.pid = os.posix_spawn(BROWSER, [BROWSER, *flags], dict(os.environ),
                                  file_actions=actions)
        for fd in ends:
            os.close(fd)
        self._buf, self._id, self.events, self.session = b"", 0, [], None

    def call(self, method: str, timeout: float = 30, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
                self.events.append(reply)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError(f"no reply to {method}")
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += chunk

    def open(self, url: str, width: int = 1200, height: int = 1500) -> None:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while self.js("document.readyState") != "complete":
            assert time.monotonic() < deadline, "the page did not load"
            time.sleep(0.05)

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def text(self, element_id: str) -> str:
        return self.js(f"document.getElementById({element_id!r}).textContent")

    def click(self, selector: str) -> None:
        """A real left click (mouse moved, pressed, released) at the element's centre."""
        x, y = self.js(f"(() => {{ const e = document.querySelector({selector!r}); "
                       "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); "
                       "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                      clickCount=1)

    def type_into(self, selector: str, text: str) -> None:
        """Click the field, select its content with Ctrl+A, type ``text`` over it."""
        self.click(selector)
        key = dict(key="a", code="KeyA", windowsVirtualKeyCode=65, modifiers=2)
        self.call("Input.dispatchKeyEvent", type="rawKeyDown", commands=["selectAll"], **key)
        self.call("Input.dispatchKeyEvent", type="keyUp", **key)
        for ch in text:
            self.call("Input.dispatchKeyEvent", type="keyDown", key=ch, text=ch,
                      unmodifiedText=ch)
            self.call("Input.dispatchKeyEvent", type="keyUp", key=ch)

    def screenshot(self, path: Path) -> None:
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                break
            time.sleep(0.05)
        os.close(self._w)
        os.close(self._r)


def artefacts(tmp_path: Path) -> Path:
    where = Path(os.environ["EQUIV_ARTIFACTS"]) if os.environ.get("EQUIV_ARTIFACTS") else tmp_path
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.mark.skipif(BROWSER is None, reason="no headless browser installed (apt-get install "
                                            "chromium)")
def test_the_seeds_exercise_in_headless_chromium(tmp_path):
    """Reset, a=1 and x=1 -> slope 2, Step -> still 2 and t advanced; edits keep t; Reset zeroes
    t and restores the defaults; a=1 and x=2 -> slope 4. The autograd panel shows the untracked
    write and the stale slope 4 with equiv's finding. A screenshot is kept as an artefact."""
    browser = DevTools(tmp_path / "profile")
    try:
        browser.open(PAGE.as_uri())
        slope = lambda: browser.text("slope")  # noqa: E731
        t = lambda: browser.text("t")  # noqa: E731

        browser.click("#reset")
        assert t() == "0.00"
        browser.type_into("#a", "1")
        browser.type_into("#x", "1")
        assert browser.js("[document.getElementById('a').value, "
                          "document.getElementById('x').value]") == ["1", "1"]
        assert slope() == "2"  # predicted before playing: the display is analytic
        browser.click("#step")
        assert (t(), slope()) == ("0.25", "2")
        browser.click("#step")
        assert t() == "0.50"
        browser.type_into("#x", "3")  # an edit keeps t and recomputes at once
        assert (t(), slope(), browser.text("fx")) == ("0.50", "6", "9")
        browser.type_into("#a", "2")
        assert (t(), slope()) == ("0.50", "12")

        browser.click("#reset")
        assert (t(), slope()) == ("0.00", "-1")  # the defaults a=0.5, x=-1
        assert browser.js("document.getElementById('a').value") == "0.5"
        browser.type_into("#a", "1")
        browser.type_into("#x", "2")
        assert (t(), slope()) == ("0.00", "4")
        browser.click("#play")
        deadline = time.monotonic() + 10
        while float(t()) < 0.75:
            assert time.monotonic() < deadline, "Play does not advance t"
            time.sleep(0.05)
        browser.click("#play")  # pause
        paused = t()
        time.sleep(0.4)
        assert t() == paused and slope() == "4"
        evals = browser.js("[...document.querySelectorAll('#evals li')].map(e => e.textContent)")
        assert any(e.startswith("a=1, x=1 ") and "slope 2 " in e for e in evals), evals
        assert any(e.startswith("a=1, x=2 ") and "slope 4 " in e for e in evals), evals
        assert "no autograd storage" in browser.text("separate-note")

        # the autograd panel, drawn from the recorded JSON
        count = "document.querySelectorAll({!r}).length".format
        assert browser.js(count("#case-untracked g.event.write.untracked")) == 1
        assert browser.js(count("#case-tracked g.event.write.untracked")) == 0
        assert browser.js(count("#case-tracked g.event.write")) == 1
        assert browser.js(count("#case-untracked g.event.read.stale")) >= 1
        assert browser.text("case-untracked-slope") == "4"
        untracked = browser.js("document.getElementById('case-untracked').innerText")
        assert "slope 4 where 2 is due" in untracked and "UNTRACKED" in untracked
        tracked = browser.js("document.getElementById('case-tracked').innerText")
        assert "autograd raises RuntimeError" in tracked and "is at version 1" in tracked
        finding = browser.text("finding")
        assert "GradientMismatch" in finding and "version NOT bumped: untracked write" in finding
        errors = [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
        assert errors == [], errors

        shot = artefacts(tmp_path) / "lab.png"
        browser.screenshot(shot)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20000
    finally:
        browser.close()
