"""Run every benchmark and regenerate bench/RESULTS.md (machine info and torch version included).

    python bench/run.py            # full sizes
    python bench/run.py --smoke    # tiny sizes: keeps the scripts from rotting (run in the tests)
    python bench/run.py --device cuda   # the GPU figures, on a machine with a GPU
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


def sections(smoke: bool, device: str) -> list[tuple[str, str, list[str]]]:
    """(title, module, argv) for each benchmark; optional modules are skipped when absent."""
    if smoke:
        return [
            ("Overhead", "overhead", ["--examples", "3", "--sizes", "100"]),
            ("Growth", "growth", ["--max-numel", "1000"]),
            ("Versus gradcheck and opcheck", "versus", []),
            ("Time to first failure", "first_failure", ["--seeds", "1"]),
            ("Compilations", "compile_counts", ["--examples", "3", "examples/rms_norm.py"]),
        ]
    extra = ["--device", device] if device != "cpu" else []
    return [
        ("Overhead: check() / raw execution (eager)", "overhead", []),
        ("Growth", "growth", []),
        ("Versus gradcheck and opcheck", "versus", []),
        ("Time to first failure (default profile)", "first_failure", []),
        ("Strategies: generation cost and compile counts", "strategies_bench", []),
        ("Recorder overhead", "recorder_bench", []),
        ("Function checks: extra cost", "functions", []),
        ("Modes: compilations and wall time", "modes_bench", extra),
        ("Compilations", "compile_counts", []),
    ]


def _run_module(module: str, argv: list[str]) -> str:
    """Run one benchmark module; its returned markdown, or what it printed as a text block."""
    import contextlib
    import inspect
    import io
    import logging

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    mod = importlib.import_module(module)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        if hasattr(mod, "main"):
            takes_argv = bool(inspect.signature(mod.main).parameters)
            result = mod.main(argv) if takes_argv else mod.main()
        else:  # a script with phases (strategies_bench)
            result = None
            for phase in ("generation", "compile_counts"):
                getattr(mod, phase)()
    printed = buf.getvalue()
    sys.stdout.write(printed)
    if isinstance(result, str) and result.strip():
        return result
    return "```text\n" + printed.rstrip() + "\n```"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="where to write the markdown (default: "
                   "bench/RESULTS.md; --smoke writes nothing unless given)")
    args = p.parse_args(argv)
    parts = ["# equiv benchmark results", "", _machine(), ""]
    for title, module, margs in sections(args.smoke, args.device):
        if not (HERE / f"{module}.py").exists():
            parts += [f"## {title}", "", f"(`bench/{module}.py` not present)", ""]
            continue
        start = time.perf_counter()
        table = _run_module(module, margs)
        parts += [f"## {title}", "", table, "",
                  f"_{module}: {time.perf_counter() - start:.1f} s_", ""]
    text = "\n".join(parts)
    out = args.out or (None if args.smoke else str(HERE / "RESULTS.md"))
    if out:
        Path(out).write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
