"""pytest plugin (entry point ``pytest11``). Imports neither torch nor equiv at load time."""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("equiv", "equiv: implementation-vs-reference equivalence")
    group.addoption("--equiv-profile", default=None,
                    help="equiv settings profile to load (default, ci, thorough)")


def pytest_configure(config: Any) -> None:
    profile = config.getoption("--equiv-profile", default=None)
    if profile:
        import equiv

        equiv.settings.load_profile(profile)
