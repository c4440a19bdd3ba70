"""Runs of ``equiv check -n N``: each (spec, mode, device) in a worker process.

The workers are forked from the command once the targets are imported and the settings
session is pushed, so each inherits the specs, the seed and the profile unchanged and runs a
task exactly as the command would in-process. Tasks are handed out one at a time (a free
worker takes the next); each result comes back as plain data (a pickled :class:`Result`:
strings, numbers and equiv's report dataclasses, read back by an unpickler that refuses
anything else, so no tensor or user object crosses). A worker that dies while running a task
(``os._exit``, a segmentation fault, a kill) becomes that task's ``error`` row naming the exit
code or signal, and a fresh worker takes the remaining tasks.

Each worker runs torch with ``cpu_count // N`` intra-op threads (at least one): N workers share
the cores instead of oversubscribing them, and a worker forked after torch's thread pool
started never enters it with one thread.
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import warnings
from collections import deque
from typing import Any, Callable

from equiv._results import _event

#: modules whose classes a result may hold (everything else is refused on the way back)
_ALLOWED = ("equiv.report", "equiv._results", "equiv.modes")
_BUILTINS = {"tuple", "list", "dict", "set", "frozenset", "bytes", "str", "int", "float",
             "bool", "complex", "NoneType", "slice", "range"}


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class _PlainUnpickler(pickle.Unpickler):
    """Reads back only builtins and equiv's report classes."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS or module in _ALLOWED \
                or module == "copyreg" and name == "_reconstructor":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not plain result data")


def _plain_bytes(result: Any) -> bytes:
    """``result`` pickled; a finding's timeline holding anything but plain values is sent as
    the JSON report writes it (the same dicts)."""
    try:
        data = pickle.dumps(result)
        _PlainUnpickler(io.BytesIO(data)).load()
        return data
    except Exception:
        pass
    report = result.report
    findings = tuple(dataclasses.replace(f, timeline=tuple(_event(e) for e in f.timeline))
                     for f in report.findings)
    return pickle.dumps(dataclasses.replace(
        result, report=dataclasses.replace(report, findings=findings)))


def _serve(conn: Any, run: Callable[[int], Any], threads: int) -> None:
    """A worker: run each task index received, send its result back; stop on ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the command's to handle
    import torch

    torch.set_num_threads(threads)
    pid = os.getpid()
    while True:
        index = conn.recv()
        if index is None:
            return
        result = run(index)
        if os.getpid() != pid:  # a process user code forked: it never reports
            os._exit(0)
        conn.send_bytes(_plain_bytes(result))


def how_it_died(exitcode: int | None) -> str:
    """A worker's end in words: ``exit code 3``, ``signal SIGSEGV``."""
    if exitcode is None:
        return "it stopped answering"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class _Pool:
    """Forked workers, each running one task at a time."""

    def __init__(self, run: Callable[[int], Any], workers: int, method: str) -> None:
        self.run, self.threads = run, max(1, available_cores() // workers)
        self.context = multiprocessing.get_context(method)
        self.busy: dict[Any, tuple[Any, int]] = {}  # connection -> (process, task index)

    def start(self, index: int) -> None:
        ours, theirs = multiprocessing.Pipe()
        process = self.context.Process(
            target=_serve, args=(theirs, self.run, self.threads))
        for stream in (sys.stdout, sys.stderr):  # no buffered text is written twice
            stream.flush()
        with warnings.catch_warnings():  # torch's threads are not entered with one thread
            warnings.filterwarnings("ignore", "This process .* is multi-threaded",
                                    DeprecationWarning)
            process.start()
        theirs.close()
        ours.send(index)
        self.busy[ours] = (process, index)

    def give(self, conn: Any, index: int | None) -> None:
        """Hand the worker behind ``conn`` its next task (``None``: stop it)."""
        process, _ = self.busy.pop(conn)
        try:
            conn.send(index)
        except OSError:  # it ended between two tasks: a fresh worker takes this one
            self.end(conn, process)
            if index is not None:
                self.start(index)
            return
        if index is None:
            self.end(conn, process)
        else:
            self.busy[conn] = (process, index)

    @staticmethod
    def end(conn: Any, process: Any) -> None:
        conn.close()
        process.join(5)
        if process.exitcode is None:
            process.kill()
            process.join()

    def stop(self) -> None:
        for conn, (process, _) in list(self.busy.items()):
            process.kill()
            self.end(conn, process)
        self.busy.clear()


def run_in_workers(count: int, run: Callable[[int], Any], crashed: Callable[[int, str], Any],
                   done: Callable[[int, Any], None], workers: int, method: str = "fork") -> None:
    """Run tasks ``0..count-1`` in ``workers`` processes started by ``method`` (``fork``,
    or ``spawn``: then ``run`` pickles and rebuilds what it needs): ``run(i)`` in a worker
    returns task i's result, ``done(i, result)`` receives it here as each finishes;
    ``crashed(i, how)`` makes the result of a task whose worker died. Ctrl-C
    (KeyboardInterrupt) kills the workers and propagates."""
    pending = deque(range(count))
    pool = _Pool(run, min(workers, count), method)
    try:
        while pending and len(pool.busy) < min(workers, count):
            pool.start(pending.popleft())
        while pool.busy:
            for conn in multiprocessing.connection.wait(list(pool.busy)):
                process, index = pool.busy[conn]
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    del pool.busy[conn]
                    pool.end(conn, process)
                    done(index, crashed(index, f"died ({how_it_died(process.exitcode)})"))
                    if pending:
                        pool.start(pending.popleft())
                    continue
                try:
                    result = _PlainUnpickler(io.BytesIO(data)).load()
                except Exception as e:  # not plain data: never trusted, never shown raw
                    result = crashed(index, f"returned a result that is not plain data ({e})")
                done(index, result)
                pool.give(conn, pending.popleft() if pending else None)
    finally:
        pool.stop()
