"""Import the files, folders and dotted modules named on a command line and find their specs.

Shared by the ``equiv`` command and the pytest plugin's ``--equiv-module`` option.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from equiv.spec import _REGISTRY, Spec


def load_target(target: str) -> list[Spec]:
    """Import a ``.py`` file, a folder of files (not recursing: ``examples/failing/`` is only
    searched when named) or a dotted module name; return the specs they define, in order.

    Exceptions raised by the user's module propagate unchanged (callers show the traceback).
    """
    path = Path(target)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
        modules = [_import_file(f) for f in files]
    elif path.suffix == ".py" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {target}")
        modules = [_import_file(path)]
    else:
        modules = [importlib.import_module(target)]
    specs: list[Spec] = []
    for m in modules:
        for s in specs_in_module(m):
            if all(s.name != t.name for t in specs):
                specs.append(s)
    return specs


def specs_in_module(module: ModuleType) -> list[Spec]:
    """The specs whose implementation is defined in ``module``: its decorated attributes in
    definition order, then any other registered spec of that module."""
    found: dict[str, Spec] = {}
    for value in list(vars(module).values()):
        spec = getattr(value, "__equiv_spec__", None)
        if isinstance(spec, Spec) and getattr(spec.impl, "__module__", None) == module.__name__:
            found.setdefault(spec.name, spec)
    for spec in list(_REGISTRY.values()):
        if getattr(spec.impl, "__module__", None) == module.__name__:
            found.setdefault(spec.name, spec)
    return list(found.values())


def _import_file(path: Path) -> ModuleType:
    path = path.resolve()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == path:
            return mod  # already imported (e.g. twice on one command line)
    candidates = [path.stem, f"{path.parent.name}.{path.stem}"]
    name = next((c for c in candidates if c not in sys.modules), None)
    n = 1
    while name is None:
        name = f"{path.parent.name}.{path.stem}_{n}" if f"{path.parent.name}.{path.stem}_{n}" \
            not in sys.modules else None
        n += 1
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.parent)
    added = folder not in sys.path
    if added:  # sibling imports work, as when running the file as a script
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if added:
            sys.path.remove(folder)
    return module
