"""Import the files, folders and dotted modules named on a command line and find their specs.

Shared by the ``equiv`` command and the pytest plugin's ``--equiv-module`` option.
"""

from __future__ import annotations

import importlib
import inspect
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

from equiv.spec import _REGISTRY, Spec


def load_target(target: str) -> list[Spec]:
    """Import a ``.py`` file, a folder of files (not recursing: ``examples/failing/`` is only
    searched when named), a package folder (an ``__init__.py`` inside: imported as the package,
    with its submodules, so relative imports work) or a dotted module name (a package: with its
    submodules); return the specs they define, in order.

    A target that names no file, folder or module raises :class:`TargetNotFound` (one line for
    the user); exceptions raised by the user's modules propagate unchanged (callers show the
    traceback).
    """
    modules = _modules(target)
    specs: dict[str, Spec] = {}
    for direct in (True, False):  # each spec first under its own module, in walk order
        for m in modules:
            for s in specs_in_module(m, direct=direct):
                specs.setdefault(s.name, s)
    return list(specs.values())


class TargetNotFound(ImportError):
    """A command-line target that is neither a file, a folder nor an importable module."""


def _modules(target: str) -> list[ModuleType]:
    path = Path(target)
    if path.is_dir():
        if (path / "__init__.py").is_file():
            return _walk(importlib.import_module(_package_name(path)))
        files = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
        return [_import_file(f) for f in files]
    if path.is_file():
        if path.suffix != ".py":
            raise TargetNotFound(f"{target}: not a Python source file (give a .py file, a "
                                 "folder of them, a package folder or a dotted module)")
        return [_import_file(path)]
    if path.suffix == ".py" or "/" in target or "\\" in target:
        raise TargetNotFound(f"no such file or folder: {target}")
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise TargetNotFound(
                f"{target} is not a file, a folder or an importable module (ModuleNotFoundError: "
                f"{e}); run from the "
                "folder that holds it, or give its path.") from None
        raise
    return _walk(module)


def _walk(module: ModuleType) -> list[ModuleType]:
    """``module`` and, for a package, every public submodule (recursively, in name order)."""
    found = [module]
    path = getattr(module, "__path__", None)
    if path is None:
        return found
    for info in sorted(pkgutil.walk_packages(path, module.__name__ + "."),
                       key=lambda i: i.name):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        found.append(importlib.import_module(info.name))
    return found


def _package_name(folder: Path) -> str:
    """The dotted name of a package folder, its topmost package's parent put on sys.path."""
    folder = folder.resolve()
    parts = [folder.name]
    root = folder.parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    name = ".".join(parts)
    if str(root) not in sys.path:  # at the end: the folder never hides an installed module
        sys.path.append(str(root))
    found = importlib.util.find_spec(parts[0])
    origin = getattr(found, "origin", None)
    if found is not None and origin is not None and \
            Path(origin).resolve().parent != (root / parts[0]).resolve():
        raise TargetNotFound(
            f"{folder}: its package name {parts[0]!r} is already taken by {origin}; rename the "
            "package, or name its modules as a dotted module from a folder that holds it")
    return name


def specs_in_module(module: ModuleType, *, direct: bool = False) -> list[Spec]:
    """The specs that belong to ``module``: its decorated attributes in definition order, then
    any other registered spec of that module (factory-made ones included), then every spec its
    import registered (``equivalent_to(ref)(pkg.kernel)`` in a specs file, for a kernel
    defined elsewhere). ``direct``: only the specs it defines or registered itself (not
    through a module it imported)."""
    found: dict[str, Spec] = {}
    values = list(vars(module).values())  # not getattr: a lazy module attribute may raise
    for value in values:
        try:
            spec = inspect.getattr_static(value, "__equiv_spec__", None)
        except Exception:  # an object whose type lookup itself fails: not a spec
            continue
        if isinstance(spec, Spec) and _belongs(spec, module.__name__, direct):
            found.setdefault(spec.name, spec)
    for spec in list(_REGISTRY.values()):
        if spec.module == module.__name__:
            found.setdefault(spec.name, spec)
    for spec in list(_REGISTRY.values()):
        if _belongs(spec, module.__name__, direct):
            found.setdefault(spec.name, spec)
    return list(found.values())


def _belongs(spec: Spec, module: str, direct: bool) -> bool:
    """Whether ``module`` defines ``spec``'s implementation or its import registered it."""
    sites = spec.sites[:1] if direct else spec.sites
    return spec.module == module or module in sites


def _import_file(path: Path) -> ModuleType:
    """Import one ``.py`` file under a module name that shadows nothing: its stem unless a
    module of that name exists elsewhere (the standard library, torch's dependencies), else
    ``<folder>.<stem>``, else a unique ``_equiv_target.<stem>``. Its folder goes at the end of ``sys.path`` while it
    runs, so sibling imports work and never hide an installed module."""
    path = path.resolve()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == path:
            return mod  # already imported (e.g. twice on one command line)
    name = _free_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetNotFound(f"{path}: not a Python source file (give a .py file, a folder "
                             "or a dotted module)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.parent)
    added = folder not in sys.path
    if added:  # sibling imports work, as when running the file as a script
        sys.path.append(folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    return module


def _free_name(path: Path) -> str:
    """A module name for ``path`` that is not imported yet and names no other module."""
    stem = path.stem
    if stem.isidentifier() and stem not in sys.modules and not _exists_elsewhere(stem, path):
        return stem
    dotted = f"{path.parent.name}.{stem}"  # never a top-level name: shadows nothing
    if stem.isidentifier() and path.parent.name.isidentifier() and dotted not in sys.modules:
        return dotted
    base = f"_equiv_target.{stem}" if stem.isidentifier() else "_equiv_target.module"
    name, n = base, 1
    while name in sys.modules:
        n += 1
        name = f"{base}_{n}"
    return name


def _exists_elsewhere(name: str, path: Path) -> bool:
    """Whether a top-level module ``name`` other than ``path`` is importable (the standard
    library, an installed package, a module of the current folder)."""
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return True
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    origin = getattr(found, "origin", None)
    return found is not None and (origin is None or Path(origin).resolve() != path)
