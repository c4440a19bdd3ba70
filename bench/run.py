"""Run every benchmark and regenerate bench/RESULTS.md (machine info and torch version included).

    python bench/run.py                 # full sizes (minutes)
    python bench/run.py --suite         # ... and the test suite's wall time
    python bench/run.py --quick --out /tmp/x.md   # tiny sizes (the tests run it; alias --smoke)
    python bench/run.py --device cuda   # the GPU figures, on a machine with a GPU

Each benchmark module exposes ``bench(**parameters)``; only its ``main``/``__main__`` reads a
command line.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _machine() -> str:
    import hypothesis
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"- date: {datetime.date.today().isoformat()}\n"
            f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
            f"{platform.release()}\n"
            f"- python {platform.python_version()}, torch {torch.__version__}, "
            f"hypothesis {hypothesis.__version__}, torch threads {torch.get_num_threads()}\n"
            f"- GPU: {cuda}")


def sections(quick: bool, device: str, suite: bool = False) -> list[tuple[str, str, dict]]:
    """(title, module, keyword arguments of its ``bench``) for each benchmark; a module that is
    absent is reported as such."""
    if quick:
        return [
            ("Overhead", "overhead", {"examples": 3, "sizes": (100,), "rounds": 1,
                                      "device": device}),
            ("Versus the hand-written test and the executed raw", "peer",
             {"examples": 2, "sizes": (1000,), "rounds": 1}),
            ("Growth", "growth", {"max_numel": 100, "examples": 2, "rounds": 1, "max_args": 2}),
            ("Versus gradcheck and opcheck", "versus", {"bugs": 2}),
            ("Time to first failure", "first_failure", {"seeds": 1, "bugs": 2}),
            ("Strategies", "strategies_bench", {"examples": 2}),
            ("Recorder overhead", "recorder_bench", {"repeats": 1}),
            ("Function checks", "functions", {"examples": 2, "repeats": 1}),
            ("Modes", "modes_bench", {"targets": [str(HERE.parent / "examples" /
                                                      "x_squared_lab.py")],
                                      "examples": 2, "modes": "eager", "device": device}),
            ("Wall time", "walltime", {"runs": 1, "quick": True, "suite": suite}),
            ("Compilations", "compile_counts", {"examples": 3, "targets": ["examples/rms_norm.py"]}),
            ("Real code: PyTorch kernels against PyTorch references", "realcode",
             {"examples": 4, "only": ("relu_", "layer_norm", "mse_loss")}),
        ]
    return [
        ("Overhead: check() / raw execution (eager)", "overhead", {"device": device}),
        ("Versus the hand-written test and the executed raw (eager)", "peer", {}),
        ("Growth", "growth", {}),
        ("Versus gradcheck and opcheck", "versus", {}),
        ("Time to first failure (default profile)", "first_failure", {}),
        ("Strategies: generation cost and compile counts", "strategies_bench", {}),
        ("Recorder overhead", "recorder_bench", {}),
        ("Function checks: extra cost", "functions", {}),
        ("Modes: compilations and wall time", "modes_bench", {"device": device}),
        ("Wall time", "walltime", {"runs": 3, "suite": suite}),
        ("Compilations", "compile_counts", {}),
        ("Real code: PyTorch kernels against PyTorch references", "realcode", {"examples": 30}),
    ]


def _run_module(module: str, kwargs: dict) -> str:
    """Run one benchmark's ``bench(**kwargs)``; its returned markdown, or what it printed as a
    text block."""
    import contextlib
    import io
    import logging

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    mod = importlib.import_module(module)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = mod.bench(**kwargs)
    printed = buf.getvalue()
    sys.stdout.write(printed)
    if isinstance(result, str) and result.strip():
        return result
    return "```text\n" + printed.rstrip() + "\n```"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", "--smoke", dest="quick", action="store_true",
                   help="tiny sizes (well under a minute): keeps the scripts from rotting")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--suite", action="store_true",
                   help="also time the test suite in the wall-time section (minutes)")
    p.add_argument("--only", default=None, metavar="M1,M2",
                   help="run only these modules, e.g. overhead,walltime")
    p.add_argument("--out", default=None, help="where to write the markdown (default: "
                   "bench/RESULTS.md; --quick writes nothing unless given)")
    args = p.parse_args(argv)
    parts = ["# equiv benchmark results", "", _machine(), ""]
    only = set(args.only.split(",")) if args.only else None
    for title, module, margs in sections(args.quick, args.device, args.suite):
        if only is not None and module not in only:
            continue
        if not (HERE / f"{module}.py").exists():
            parts += [f"## {title}", "", f"(`bench/{module}.py` not present)", ""]
            continue
        start = time.perf_counter()
        table = _run_module(module, margs)
        parts += [f"## {title}", "", table, "",
                  f"_{module}: {time.perf_counter() - start:.1f} s_", ""]
    text = "\n".join(parts)
    out = args.out or (None if args.quick else str(HERE / "RESULTS.md"))
    if out:
        Path(out).write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
