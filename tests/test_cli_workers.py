"""``equiv check -n N``: specs run in worker processes give the report and the output of one
process; a worker that dies is an error row naming the crash, and the rest of the run goes on."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import tempfile
import textwrap
from typing import Iterator

import pytest
import torch

from equiv.cli import main

QUICK = ["--modes", "eager", "--max-examples", "4", "--seed", "7"]

SPECS = {
    "good.py": '''
        import os
        import torch
        from equiv import equivalent_to

        def double_ref(x):
            return x * 2

        @equivalent_to(double_ref)
        def double(x):
            return x + x

        @equivalent_to(double_ref)
        def double_forking(x):
            """Correct, and forks a child that returns too: only the worker reports."""
            pid = os.fork()
            if pid:
                os.waitpid(pid, 0)
            return x * 2
    ''',
    "bad.py": '''
        import torch
        from equiv import equivalent_to

        def double_ref(x):
            return x * 2

        @equivalent_to(double_ref, mutates={"x": "out"})
        def double_(x):
            x[:-1].mul_(2)
            return x
    ''',
    "crash.py": '''
        import ctypes
        import os
        import signal
        from equiv import equivalent_to

        def double_ref(x):
            return x * 2

        @equivalent_to(double_ref)
        def crash_exits(x):
            os._exit(3)

        @equivalent_to(double_ref)
        def crash_killed(x):
            os.kill(os.getpid(), signal.SIGKILL)

        @equivalent_to(double_ref)
        def crash_segfaults(x):
            ctypes.string_at(0)
    ''',
}


@contextlib.contextmanager
def _default() -> Iterator[None]:
    """The default profile, whatever CI or EQUIV_PROFILE say."""
    import equiv

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CI", raising=False)
        mp.delenv("EQUIV_PROFILE", raising=False)
        previous = equiv.settings._push_session("default")
        try:
            yield
        finally:
            equiv.settings._pop_session(previous)


@pytest.fixture(autouse=True)
def _default_profile():
    with _default():
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    where = tmp_path_factory.mktemp("specs")
    for name, source in SPECS.items():
        (where / name).write_text(textwrap.dedent(source))
    return where


def run(*argv: str) -> tuple[int, str, str]:
    """The command in a fresh working directory: no run replays what Hypothesis's example
    database (``.hypothesis/`` there) saved from another."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(tempfile.mkdtemp())
    try:
        code = main(list(argv), out=out, err=err)
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def serial(folder):
    """The passing and failing specs run in this process: (exit, output, JSON text)."""
    report = folder / "serial.json"
    with _default():  # a module fixture runs before the function-scoped _default_profile
        code, out, _ = run("check", str(folder), "-k", "not crash", *QUICK, "--json", str(report))
    return code, out, report.read_text()


def test_two_workers_write_the_report_and_output_of_one_process(folder, serial):
    report = folder / "two.json"
    code, out, err = run("check", str(folder), "-k", "not crash", *QUICK, "-n", "2",
                         "--json", str(report))
    assert (code, out, report.read_text()) == serial
    assert err == ""
    doc = json.loads(serial[2])
    assert [(r["spec"], r["verdict"]) for r in doc["results"]] == [
        ("bad.double_", "fail"), ("good.double", "pass"), ("good.double_forking", "pass")]


def test_a_worker_that_dies_is_an_error_row_naming_the_crash_and_the_rest_runs(folder, serial):
    report = folder / "crash.json"
    code, out, _ = run("check", str(folder), *QUICK, "-n", "2", "--json", str(report))
    assert code == 2  # a run with a crash is not a pass
    rows = {r["spec"]: r for r in json.loads(report.read_text())["results"]}
    how = {"crash.crash_exits": "exit code 3", "crash.crash_killed": "signal SIGKILL",
           "crash.crash_segfaults": "signal SIGSEGV"}
    for spec, end in how.items():
        assert rows[spec]["verdict"] == "error"
        assert rows[spec]["reason"].startswith(
            f"{spec}: the worker process checking it under eager on cpu died ({end}) before "
            "returning a result"), rows[spec]["reason"]
        assert f"== ERROR: {spec} [eager-cpu] ==" in out
    before = {r["spec"]: r for r in json.loads(serial[2])["results"]}
    assert {s: rows[s] for s in before} == before
    assert "2 pass, 1 FAIL, 3 ERROR" in out.splitlines()


def test_one_worker_runs_every_spec_in_order_after_a_crash(folder, serial):
    """-n 1: a fresh worker takes the tasks after the one that killed its predecessor."""
    report = folder / "one.json"
    code, _, _ = run("check", str(folder), "-k", "exits or double", *QUICK, "-n", "1",
                     "--json", str(report))
    assert code == 2
    assert [(r["spec"], r["verdict"]) for r in json.loads(report.read_text())["results"]] == [
        ("bad.double_", "fail"), ("crash.crash_exits", "error"), ("good.double", "pass"),
        ("good.double_forking", "pass")]


@pytest.mark.parametrize("value", ["-1", "two", ""])
def test_a_bad_worker_count_exits_2_naming_the_option(value, capsys, folder):
    with pytest.raises(SystemExit) as info:
        main(["check", str(folder), "-n", value])
    assert info.value.code == 2
    assert f"argument -n/--workers: {value!r}: give a number of worker processes >= 0 or " \
        "auto" in capsys.readouterr().err


def test_auto_is_one_worker_per_available_core():
    from equiv._workers import available_cores
    from equiv.cli import _parser

    args = _parser().parse_args(["check", "x.py", "-n", "auto"])
    assert args.workers == available_cores() >= 1
    assert _parser().parse_args(["check", "x.py"]).workers == 0


def test_results_come_back_as_plain_data_only():
    """The reader of a worker's result refuses a tensor (or any non-report object)."""
    from equiv._results import Result
    from equiv._workers import _PlainUnpickler
    from equiv.report import Finding, Report

    finding = Finding(check="forward", headline="differs", index=(1,), timeline=({"a": 1},))
    result = Result(spec="s", implementation="i", reference="r", mode="eager", device="cpu",
                    verdict="fail", report=Report(spec="s", implementation="i", reference="r",
                                                  findings=(finding,)))
    assert _PlainUnpickler(io.BytesIO(pickle.dumps(result))).load() == result
    with pytest.raises(pickle.UnpicklingError, match="torch.* is not plain result data"):
        _PlainUnpickler(io.BytesIO(pickle.dumps(torch.ones(2)))).load()


def test_spawned_workers_import_the_targets_and_give_the_same_report(folder, serial,
                                                                     monkeypatch):
    """The start method used when a run needs CUDA (a fork cannot use it): each worker
    imports the targets and pushes the settings itself, and the runs are the same. (A
    spawned worker opens Hypothesis's example database afresh in its working directory,
    where this test process opened its own once: the failing run's example count may differ
    by what a database replays, so that row is compared by verdict and checks.)"""
    import equiv.cli

    monkeypatch.setattr(equiv.cli, "_start_method", lambda tasks: "spawn")
    report = folder / "spawned.json"
    code, out, _ = run("check", str(folder), "-k", "not crash", *QUICK, "-n", "2",
                       "--json", str(report))
    assert code == serial[0] == 1

    def rows(text):
        return [r if r["verdict"] == "pass" else (r["spec"], r["verdict"], r["seed"], sorted(
            f["check"] for f in r["findings"])) for r in json.loads(text)["results"]]

    assert rows(report.read_text()) == rows(serial[2])


def test_a_run_on_an_available_accelerator_spawns_its_workers():
    from equiv.cli import _start_method

    assert _start_method([(None, "eager", "cpu"), (None, "eager", "cuda")]) == (
        "spawn" if torch.cuda.is_available() else "fork")
    assert _start_method([(None, "eager", "nosuchdevice")]) == "fork"
