"""Report files written honestly, and user text made safe to show.

The paths of ``--json``/``--html`` (``--equiv-report``/``--equiv-html``) are validated and made
absolute before any user code runs; a stale report at one of them is removed then, and the new
one is written at the end through a temporary file and ``os.replace``, so a file at that path
is always a whole report of this run (``"complete": false`` when the run ended early) or
nothing. Strings from user code are scrubbed of memory addresses and lone surrogates; shown on
a terminal or a page, control characters are escaped.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

#: what a report file this tool wrote begins with (JSON, HTML)
_MARKERS = ('{\n  "schema": "equiv.results/', "<!DOCTYPE html>\n<html lang=\"en\"><head><meta "
            "charset=\"utf-8\">\n<title>equiv report</title>")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: C0 controls but tab and newline, DEL, C1 controls
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: how a non-finite float is written in a report (strict JSON has no Infinity or NaN)
NON_FINITE = {math.inf: "inf", -math.inf: "-inf"}


class ReportPathError(ValueError):
    """A report path refused before the run: ``flag`` names the option."""

    def __init__(self, flag: str, path: str, problem: str) -> None:
        super().__init__(f"{flag} {path if path.strip() else repr(path)}: {problem}")
        self.flag, self.path, self.problem = flag, path, problem


def scrub(text: str) -> str:
    """``text`` without memory addresses (``<Tag object at 0x7f..>`` -> ``<Tag object>``, so two
    runs with one seed agree) and with lone surrogates as ``\\udcxx`` escapes (encodable)."""
    text = _ADDRESS.sub("", text)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def visible(text: Any, *, lines: bool = True) -> str:
    """``text`` safe for a terminal or a page: scrubbed, every control character (ESC, BEL,
    CR...) shown as its escape; newlines and tabs kept when ``lines``, else escaped too (one
    table cell, one line)."""
    pattern = _CONTROL if lines else _CONTROL_OR_NEWLINE
    return pattern.sub(lambda m: repr(m.group())[1:-1], scrub(str(text)))


def strict(value: Any) -> Any:
    """A strict-JSON copy of ``value``: strings scrubbed, non-finite floats as the strings
    ``"inf"``, ``"-inf"`` and ``"nan"``, tuples as lists."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, float) and not math.isfinite(value):
        return NON_FINITE.get(value, "nan")
    if isinstance(value, dict):
        return {scrub(str(k)): strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def is_report(path: Path) -> bool:
    """Whether the file at ``path`` is empty or a report this tool wrote."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(200).decode("utf-8", "replace")
    except OSError:
        return False
    return head == "" or any(head.startswith(m) for m in _MARKERS)


def prepare(paths: Iterable[tuple[str, str | None]], sources: Iterable[Path] = ()) -> dict[str, str]:
    """Validate each ``(flag, path)`` given (``None``: not asked for) and return the absolute
    paths by flag; each existing report there is removed (a stale file must not pass for this
    run's). Raises :class:`ReportPathError` naming the flag before anything is removed."""
    checked = {Path(s).resolve() for s in sources}
    resolved: dict[str, str] = {}
    for flag, path in paths:
        if path is None:
            continue
        where = _validate(flag, path, checked)
        for other, seen in resolved.items():
            if seen == where:
                raise ReportPathError(flag, path, f"the same file as {other}; give each report "
                                      "its own path")
        resolved[flag] = where
    for where in resolved.values():
        if os.path.lexists(where):
            os.remove(where)
    return resolved


def _validate(flag: str, path: str, sources: set[Path]) -> str:
    if not path.strip():
        raise ReportPathError(flag, path, f"an empty path; give a file name, e.g. {flag} "
                              f"equiv.{'json' if 'html' not in flag else 'html'}")
    where = Path(path).resolve()
    if where in sources:
        raise ReportPathError(flag, path, "it is a source file being checked; give another "
                              "path for the report")
    if where.is_dir():
        raise ReportPathError(flag, path, "it is a folder; give a file path")
    if where.exists() and not is_report(where):
        raise ReportPathError(flag, path, "an existing file that is not an equiv report; "
                              "remove it or give another path")
    existed = where.exists()
    try:
        with open(where, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ReportPathError(flag, path, f"cannot write there ({e.strerror or e})") from None
    if not existed:
        os.remove(where)
    return str(where)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder and ``os.replace``:
    a reader sees the old state or the whole new file, never a part."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
