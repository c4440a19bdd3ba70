"""A run you can trust: every spec collected where it was registered, selection with -k, and
report files that cannot lie (validated paths, stale files removed, atomic writes, incomplete
runs marked, strict JSON matching docs/report-schema.md, user text escaped and scrubbed).
User code that exits, chdirs or is interrupted runs in subprocesses."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv.cli import main
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--profile", "default", "--modes", "eager", "--devices", "cpu", "--max-examples", "3",
         "--seed", "1"]
PLUGIN_QUICK = ["--equiv-profile=default", "--equiv-modes=eager", "--equiv-devices=cpu",
                "--equiv-max-examples=3", "--equiv-seed=1"]

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _default_profile(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("EQUIV_PROFILE", raising=False)
    previous = equiv.settings._push_session("default")
    yield
    equiv.settings._pop_session(previous)


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("CI", "EQUIV_PROFILE")}
    e["PYTHONIOENCODING"] = "utf-8"  # strict: a lone surrogate printed raw would crash
    return e


def cmd(cwd: Path, *argv: str, module: str = "equiv") -> subprocess.CompletedProcess:
    """``python -m equiv ARGV`` (or another module) in ``cwd``; output as bytes."""
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=env(),
                          capture_output=True, timeout=600)


def text(proc: subprocess.CompletedProcess) -> tuple[str, str]:
    return (proc.stdout.decode("utf-8", "surrogateescape"),
            proc.stderr.decode("utf-8", "surrogateescape"))


def in_process(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def rows(out: str) -> dict[str, list[list[str]]]:
    table: dict[str, list[list[str]]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if len(cells) == 6 and cells[0] != "spec" and not set(cells[0]) <= {"-"}:
            table.setdefault(cells[0], []).append(cells[1:])
    return table


# -- collection by registration site: the newcomer layout --------------------------------------
KERNELS = '''
    import torch

    def scale_(x):
        x.mul_(2)
        return x

    def neg_(x):
        x.neg_()
        return x

    def scale_wrong_(x):
        x[:-1].mul_(2)        # bug: the last element is not doubled
        return x
'''
SPECS_CORRECT = '''
    import torch
    import fastops.act
    import fastops.rmsnorm
    from equiv import equivalent_to

    def scale_ref(x):
        return x * 2

    def neg_ref(x):
        return -x

    def relu_ref(x):
        return torch.relu(x)

    equivalent_to(scale_ref, mutates={"x": "out"})(fastops.rmsnorm.scale_)
    equivalent_to(neg_ref, mutates={"x": "out"}, name="probe_neg")(fastops.rmsnorm.neg_)

    def _register():   # registered through a helper, still by this file's import
        equivalent_to(relu_ref, mutates={"x": "out"})(fastops.act.relu_)

    _register()
'''
SPECS_BUGGY = '''
    import fastops.rmsnorm
    from equiv import equivalent_to

    def scale_ref(x):
        return x * 2

    equivalent_to(scale_ref, mutates={"x": "out"}, name="buggy_scale")(
        fastops.rmsnorm.scale_wrong_)
'''
TESTS_FOR = '''
    import specs_correct
    from equiv.pytest import tests_for

    test_correct = tests_for(specs_correct)
'''


@pytest.fixture
def newcomer(tmp_path: Path) -> Path:
    """A package of kernels with no equiv in it, and spec files registering them with the
    function form, as a new user lays a project out."""
    write(tmp_path, "fastops/__init__.py", "from . import act, rmsnorm\n")
    write(tmp_path, "fastops/rmsnorm.py", KERNELS)
    write(tmp_path, "fastops/act.py", "def relu_(x):\n    x.clamp_(min=0)\n    return x\n")
    write(tmp_path, "tests/specs_correct.py", SPECS_CORRECT)
    write(tmp_path, "tests/specs_buggy.py", SPECS_BUGGY)
    write(tmp_path, "tests/nothing.py", "import fastops\n")
    write(tmp_path, "tests/test_specs.py", TESTS_FOR)
    return tmp_path


CORRECT = {"fastops.rmsnorm.scale_", "probe_neg", "fastops.act.relu_"}


def test_the_cli_finds_every_spec_a_file_registered_for_kernels_defined_elsewhere(newcomer):
    out, err = text(proc := cmd(newcomer, "check", "tests/specs_correct.py",
                                "tests/specs_buggy.py", *QUICK))
    table = rows(out)
    assert proc.returncode == 1, out + err
    assert set(table) == CORRECT | {"buggy_scale"}, out
    assert all(table[n][0][2] == "pass" for n in CORRECT), out
    assert table["buggy_scale"][0][2] == "FAIL"
    assert "equiv: tests/specs_correct.py: 3 specs registered" in out
    assert "equiv: tests/specs_buggy.py: 1 spec registered" in out
    out, err = text(proc := cmd(newcomer, "list", "tests/specs_correct.py"))
    assert proc.returncode == 0, err
    assert {ln for ln in out.splitlines() if ln and not ln.startswith((" ", "equiv:"))} == CORRECT


def test_a_target_that_registers_no_spec_is_exit_2_naming_it(newcomer):
    out, err = text(proc := cmd(newcomer, "check", "tests/specs_correct.py", "tests/nothing.py",
                                *QUICK))
    assert proc.returncode == 2 and out == ""
    assert err.startswith("equiv: no specs found in tests/nothing.py: importing it registered "
                          "no spec"), err
    assert "Traceback" not in err


def test_tests_for_and_equiv_module_find_every_spec_a_file_registered(newcomer):
    proc = cmd(newcomer, "tests/test_specs.py", "--equiv-module=tests/specs_buggy.py",
               "--equiv-module=tests/specs_correct.py", *PLUGIN_QUICK, "-q", "-p", "no:xdist",
               "-p", "no:cacheprovider", "-W", "ignore", module="pytest")
    out, _ = text(proc)
    # tests_for(specs_correct): 3 items; --equiv-module: 1 + 3 items
    assert re.search(r"\b1 failed, 6 passed\b", out), out
    assert "buggy_scale[eager-cpu]" in out


# -- selection: -k --------------------------------------------------------------------------
def test_dash_k_selects_specs_by_name_with_pytest_semantics(newcomer):
    out, err = text(proc := cmd(newcomer, "check", "tests/specs_correct.py",
                                "tests/specs_buggy.py", "-k", "scale and not buggy", *QUICK))
    assert proc.returncode == 0, out + err
    assert set(rows(out)) == {"fastops.rmsnorm.scale_"}
    assert "equiv: -k scale and not buggy selected 1 of 4 specs" in out
    out, err = text(proc := cmd(newcomer, "list", "tests/specs_correct.py", "-k", "NEG or relu"))
    assert proc.returncode == 0, err
    assert {ln for ln in out.splitlines() if ln and not ln.startswith((" ", "equiv:"))} == {
        "probe_neg", "fastops.act.relu_"}


def test_dash_k_matching_nothing_or_malformed_is_exit_2(tmp_path):
    path = write(tmp_path, "k_selection.py", GOOD)
    code, out, err = in_process("list", str(path), "-k", "nomatch")
    assert (code, out) == (2, "")
    assert err == "equiv: -k 'nomatch' matches none of the 1 specs found (k_selection.double).\n"
    code, out, err = in_process("check", str(path), *QUICK, "-k", "double and")
    assert (code, out) == (2, "")
    assert err.startswith("equiv: -k 'double and': not a valid -k expression"), err


# -- 1. report paths are validated before any user code runs ---------------------------------
GOOD = '''
    import pathlib
    from equiv import equivalent_to

    pathlib.Path(__file__).with_name("imported.marker").write_text("imported")

    def ref(x):
        return x * 2

    @equivalent_to(ref)
    def double(x):
        return x + x
'''


@pytest.mark.parametrize("options, message", [
    (["--json", "{good}"], "--json {good}: it is a source file being checked"),
    (["--json", "{dir}/out", "--html", "{dir}/out"], "--html {dir}/out: the same file as --json"),
    (["--json", ""], "--json '': an empty path"),
    (["--html", "{dir}/notes.txt"], "--html {dir}/notes.txt: an existing file that is not an "
     "equiv report"),
    (["--json", "{dir}"], "--json {dir}: it is a folder"),
])
def test_a_bad_report_path_is_exit_2_before_the_targets_are_imported(tmp_path, options, message):
    good = write(tmp_path, "good_reports.py", GOOD)
    notes = write(tmp_path, "notes.txt", "my notes\n")
    fill = {"good": str(good), "dir": str(tmp_path)}
    code, out, err = in_process("check", str(good), *QUICK, *(o.format(**fill) for o in options))
    assert (code, out) == (2, "")
    assert err.startswith("equiv: " + message.format(**fill)), err
    assert err.rstrip().endswith("nothing was run.")
    assert not (tmp_path / "imported.marker").exists()  # no user code ran
    assert good.read_text() == textwrap.dedent(GOOD) and notes.read_text() == "my notes\n"


# -- 2, 3. stale reports removed, chdir cannot move them, an interrupted run is marked --------
CHDIR = '''
    import os
    from equiv import equivalent_to

    def ref(x):
        return x * 2

    @equivalent_to(ref)
    def double_chdir(x):
        os.makedirs("elsewhere", exist_ok=True)
        os.chdir("elsewhere")      # the spec moves the process's working directory
        return x + x
'''
EXITS = '''
    import os
    from equiv import equivalent_to

    def ref(x):
        return x * 2

    @equivalent_to(ref)
    def exits(x):
        os._exit(0)
'''
SLEEPS = '''
    import pathlib, time
    from equiv import equivalent_to

    MARK = pathlib.Path(__file__).with_name("started.marker")

    def ref(x):
        return x * 2

    @equivalent_to(ref)
    def a_first(x):
        return x + x

    @equivalent_to(ref)
    def b_sleeps(x):
        MARK.write_text("started")
        time.sleep(120)
        return x + x
'''


def test_reports_land_where_asked_and_a_killed_run_leaves_no_stale_report(tmp_path):
    write(tmp_path, "chdir_kernels.py", CHDIR)
    write(tmp_path, "exit_kernels.py", EXITS)
    out, err = text(proc := cmd(tmp_path, "check", "chdir_kernels.py", *QUICK,
                                "--json", "r.json", "--html", "r.html"))
    assert proc.returncode == 0, out + err
    assert not list(tmp_path.glob("elsewhere/r.*"))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["complete"] is True and doc["summary"]["pass"] == 1
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    proc = cmd(tmp_path, "check", "exit_kernels.py", *QUICK, "--json", "r.json", "--html",
               "r.html")
    assert proc.returncode == 0  # the kernel's os._exit(0): nothing of equiv's ran after it
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.html").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("r.")) == []


def _interruptible() -> None:
    """In the child: SIGINT at its default, as in a terminal. A job started in the background
    by a non-interactive shell inherits SIGINT ignored, and Python then keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_sigint_writes_a_report_marked_incomplete_with_what_finished(tmp_path):
    write(tmp_path, "sleep_kernels.py", SLEEPS)
    (tmp_path / "r.json").write_text('{\n  "schema": "equiv.results/1", "old": true}\n')
    child = subprocess.Popen([sys.executable, "-m", "equiv", "check", "sleep_kernels.py", *QUICK,
                              "--json", "r.json", "--html", "r.html"], cwd=tmp_path, env=env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=_interruptible)
    deadline = time.monotonic() + 300
    while not (tmp_path / "started.marker").exists() and time.monotonic() < deadline:
        assert child.poll() is None, child.communicate()
        time.sleep(0.2)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, (out + err).decode()
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["complete"] is False and "old" not in doc
    assert [(r["spec"], r["verdict"]) for r in doc["results"]] == [
        ("sleep_kernels.a_first", "pass")]
    assert 'id="incomplete"' in (tmp_path / "r.html").read_text()
    assert b"report files (marked incomplete) hold only those" in out


# -- 4, 5, 6. hostile messages: surrogates, non-finite numbers, addresses, control characters --
HOSTILE = '''
    import math
    import torch
    from equiv import equivalent_to

    class Tag:
        pass

    def ref(x):
        return x * 2

    @equivalent_to(ref)
    def latin1_path(x):
        raise OSError("cannot open /data/caf\\udce9.bin")   # a lone surrogate

    @equivalent_to(ref)
    def infinite(x):
        return x * 2 + math.inf

    @equivalent_to(ref)
    def tagged(x):
        raise ValueError(f"bad tag {Tag()}")

    @equivalent_to(ref, name="evil\\nforged  eager  cpu  pass  3  0")
    def controls(x):
        raise ValueError("\\x1b[2J\\x07cleared your screen")

    def square_ref(x):
        return x * x

    @equivalent_to(square_ref, examples=[(torch.tensor([1.0], requires_grad=True),)])
    def square_advance(x):          # overwrites its saved input through .data: a timeline
        y = x * x
        x.data.add_(1.0)
        return y
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    write(folder, "hostile_kernels.py", HOSTILE)
    return cmd(folder, "check", "hostile_kernels.py", *QUICK, "--json", "r.json", "--html",
               "r.html"), folder


def _no_constants(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


def test_hostile_messages_never_crash_the_reporters_and_are_escaped(hostile):
    proc, folder = hostile
    out, err = text(proc)
    assert proc.returncode == 1, out + err
    assert "Traceback" not in err and err == "", err
    for raw in (b"\x1b", b"\x07"):
        assert raw not in proc.stdout and raw not in (folder / "r.html").read_bytes()
    assert "\\x1b[2J\\x07cleared your screen" in out
    assert "evil\\nforged" in out  # the name= newline is shown escaped: one row, no forgery
    assert not any(line.startswith("forged") for line in out.splitlines())
    assert "caf\\udce9.bin" in out
    html = (folder / "r.html").read_text(encoding="utf-8")
    assert "caf\\udce9.bin" in html and html.rstrip().endswith("</html>")


def test_reports_are_strict_json_without_addresses(hostile):
    proc, folder = hostile
    raw = (folder / "r.json").read_text(encoding="utf-8")
    doc = json.loads(raw, parse_constant=_no_constants)
    assert doc["complete"] is True
    assert not re.search(r" at 0x[0-9a-fA-F]+", raw + text(proc)[0])
    assert "<hostile_kernels.Tag object>" in raw
    infinite = next(r for r in doc["results"] if r["spec"] == "hostile_kernels.infinite")
    numbers = infinite["findings"][0]["numbers"]
    assert "inf" in (numbers["max_abs"], numbers["max_rel"]), numbers


def _schema_tables() -> dict[str, dict[str, str]]:
    """docs/report-schema.md's tables: {section: {key: type}}."""
    tables: dict[str, dict[str, str]] = {}
    section = ""
    for line in (ROOT / "docs" / "report-schema.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].split(" (")[0]
            tables[section] = {}
        elif line.startswith("| `") and section:
            cells = [c.strip() for c in line.strip("|").split("|")]
            for key in re.findall(r"`([^`]+)`", cells[0]):
                tables[section][key] = cells[1]
    return tables


def _check_type(value, kind: str, tables, where: str) -> None:
    nullable = kind.endswith(" or null")
    kind = kind.removesuffix(" or null")
    if value is None:
        assert nullable, f"{where} is null, typed {kind!r}"
        return
    simple = {"string": str, "int": int, "bool": bool, "object": dict}
    if kind in simple:
        assert isinstance(value, simple[kind]) and not (kind == "int" and isinstance(value, bool)), (
            f"{where} = {value!r} is not {kind}")
    elif kind == "list of strings":
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), where
    elif kind.startswith("list of "):
        table = tables["Event" if kind == "list of Event" else kind[8:]]
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            _check_object(item, table, tables, f"{where}[{i}]")
    else:
        raise AssertionError(f"docs/report-schema.md types {where} as {kind!r}, unknown here")


def _check_object(obj: dict, table: dict[str, str], tables, where: str) -> None:
    for key, value in obj.items():
        if key in table:
            _check_type(value, table[key], tables, f"{where}.{key}")
        else:
            assert value is not None, f"{where}.{key} is null (an undocumented key)"


def test_a_real_report_matches_the_schema_doc(hostile):
    """Every key docs/report-schema.md types is of that type in a real report (findings of
    several checks, a timeline, non-finite numbers); a key it does not type is never null."""
    _, folder = hostile
    doc = json.loads((folder / "r.json").read_text(encoding="utf-8"))
    tables = _schema_tables()
    assert set(tables["Top level"]) <= set(doc) | {"nodeid"}
    _check_object(doc, tables["Top level"], tables, "report")
    events = [e for r in doc["results"] for f in r["findings"] for e in f["timeline"]]
    assert events, "the report has no timeline events to validate"
    for f in (f for r in doc["results"] for f in r["findings"]):
        assert set(tables["Finding"]) <= set(f)


def test_the_plugin_reports_survive_surrogates_and_a_chdir(pytester):
    pytester.makepyfile(plugin_hostile=textwrap.dedent('''
        import os
        from equiv import equivalent_to

        def ref(x):
            return x * 2

        @equivalent_to(ref)
        def latin1_path(x):
            raise OSError("cannot open /data/caf\\udce9.bin")

        @equivalent_to(ref)
        def double_chdir(x):
            os.makedirs("elsewhere", exist_ok=True)
            os.chdir("elsewhere")
            return x + x
    '''))
    result = pytester.runpytest_subprocess("--equiv-module=plugin_hostile.py", *PLUGIN_QUICK,
                                           "--equiv-html=r.html", "--equiv-report=r.json",
                                           "-p", "no:xdist", "-W", "ignore")
    text_out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in text_out and "UnicodeEncodeError" not in text_out
    assert result.parseoutcomes().get("failed") == 1 and result.parseoutcomes().get("passed") == 1
    html = (pytester.path / "r.html").read_text(encoding="utf-8")
    assert "caf\\udce9.bin" in html
    doc = json.loads((pytester.path / "r.json").read_text(), parse_constant=_no_constants)
    assert doc["complete"] is True and len(doc["results"]) == 2


# -- 7. targets named like modules equiv and torch import ------------------------------------
SHADOW = '''
    from equiv import equivalent_to

    def ref(x):
        return x * 2

    @equivalent_to(ref)
    def {name}_double(x):
        return x + x
'''


def test_targets_named_html_and_sympy_shadow_nothing(tmp_path):
    write(tmp_path, "html.py", SHADOW.format(name="html"))
    write(tmp_path, "sympy.py", SHADOW.format(name="sympy"))
    out, err = text(proc := cmd(tmp_path, "check", "html.py", "sympy.py", "--profile",
                                "default", "--modes", "eager,compile[eager]", "--devices", "cpu",
                                "--max-examples", "2", "--seed", "1", "--html", "r.html"))
    assert proc.returncode == 0, out + err
    assert [row[2] for spec in rows(out).values() for row in spec] == ["pass"] * 4, out
    assert "equiv report" in (tmp_path / "r.html").read_text()


# -- 13. a file that is not Python; check(spec.impl) for a custom op -------------------------
def test_a_target_that_is_not_python_is_one_line_and_exit_2(tmp_path):
    notes = write(tmp_path, "notes.md", "# my notes\n")
    code, out, err = in_process("check", str(notes), *QUICK)
    assert (code, out) == (2, "")
    assert err == f"equiv: {notes}: not a Python source file (give a .py file, a folder of " \
        "them, a package folder or a dotted module)\n"


@torch.library.custom_op("equiv_trust::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@torch.library.custom_op("equiv_trust::triple_wrong", mutates_args=())
def triple_wrong(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 0.5


for _op in (triple, triple_wrong):
    _op.register_fake(lambda x: torch.empty_like(x))
    _op.register_autograd(lambda ctx, grad: grad * 3)


def test_check_takes_a_custom_ops_spec_impl_like_the_spec():
    good = equivalent_to(lambda x: x * 3)(triple).__equiv_spec__
    bad = equivalent_to(lambda x: x * 3)(triple_wrong).__equiv_spec__
    settings = equiv.settings(FAST, max_examples=2)
    assert equiv.check(good.impl, settings=settings).ok
    assert equiv.check(good, settings=settings).ok
    with pytest.raises(equiv.OutputMismatch):
        equiv.check(bad.impl, settings=settings)
