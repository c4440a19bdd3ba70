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
        ]
    extra = ["--device", device] if device != "cpu" else []
    return [
        ("Overhead: check() / raw execution (eager)", "overhead", []),
        ("Growth", "growth", []),
        ("Versus gradcheck and opcheck", "versus", []),
        ("Time to first failure (default profile)", "first_failure", []),
        ("Strategies: generation cost and compile counts", "strategies_bench", []),
        ("Recorder overhead", "recorder_bench", []),
        ("Modes: compilations and wall time", "modes_bench", extra),
    ]


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
        mod = importlib.import_module(module)
        table = mod.main(margs)
        parts += [f"## {title}", "", table or "", "",
                  f"_{module}: {time.perf_counter() - start:.1f} s_", ""]
    text = "\n".join(parts)
    out = args.out or (None if args.smoke else str(HERE / "RESULTS.md"))
    if out:
        Path(out).write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
