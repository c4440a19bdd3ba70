"""The ``equiv`` command: ``equiv check PATH_OR_MODULE...`` and ``equiv list ...``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Sequence

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


def _import_target(target: str) -> list[str]:
    """Import a file, a folder of files (not recursing into ``failing/``-style subfolders
    unless named) or a dotted module; return the spec names it registered."""
    from equiv.spec import _REGISTRY

    before = set(_REGISTRY)
    path = Path(target)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
    elif path.suffix == ".py" or path.exists():
        files = [path]
    else:
        importlib.import_module(target)
        files = []
    for f in files:
        name = f.stem if f.stem not in sys.modules else f"{f.parent.name}.{f.stem}"
        spec = importlib.util.spec_from_file_location(name, f)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {f}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return [n for n in _REGISTRY if n not in before]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="equiv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="run every registered spec found in the targets")
    p_check.add_argument("targets", nargs="+", help="files, folders or dotted module names")
    p_check.add_argument("--max-examples", type=int, default=None)
    p_check.add_argument("--seed", type=int, default=None)
    p_check.add_argument("--profile", default=None, help="settings profile: default, ci, thorough")
    p_list = sub.add_parser("list", help="list the specs found in the targets")
    p_list.add_argument("targets", nargs="+")
    args = parser.parse_args(argv)

    import equiv

    if getattr(args, "profile", None):
        try:
            equiv.settings.load_profile(args.profile)
        except equiv.InvalidArgument as e:
            print(f"equiv: {e}", file=sys.stderr)
            return EXIT_USAGE
    names: list[str] = []
    for target in args.targets:
        try:
            names += _import_target(target)
        except Exception:  # an import error in the user's module: show it, exit 2
            print(f"equiv: could not import {target}:", file=sys.stderr)
            traceback.print_exc()
            return EXIT_USAGE
    specs = equiv.registry()
    if args.command == "list":
        for n in names:
            s = specs[n]
            print(f"{n}  ref={s.reference}  mutates={dict(s.mutates) or '{}'}")
        return EXIT_OK
    if not names:
        print("equiv: no specs found (decorate implementations with @equivalent_to).",
              file=sys.stderr)
        return EXIT_USAGE
    failed = 0
    for n in names:
        try:
            report = equiv.check(specs[n].impl, max_examples=args.max_examples, seed=args.seed,
                                 raise_on_failure=False)
        except equiv.InvalidArgument as e:
            print(f"ERROR  {n}: {e}")
            failed += 1
            continue
        if report.ok:
            print("PASS   " + report.headline())
        else:
            failed += 1
            print("FAIL   " + report.render())
            print()
    print(f"{len(names) - failed} passed, {failed} failed")
    return EXIT_FINDINGS if failed else EXIT_OK
