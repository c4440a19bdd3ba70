"""Every ```python block in README.md and docs/*.md runs (blocks of one file share a namespace,
in order), so the documentation cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_collector_finds_blocks():
    """Guard against a collector that silently runs nothing."""
    blocks = BLOCK.findall((ROOT / "README.md").read_text())
    assert blocks and "equivalent_to" in blocks[0]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = BLOCK.findall(path.read_text())
    if not blocks:
        pytest.skip(f"{path.name} has no python blocks")
    monkeypatch.chdir(ROOT)
    # doc blocks may register or load profiles: keep them from leaking into other tests
    import hypothesis

    import equiv

    monkeypatch.setattr(equiv.settings, "_profiles", dict(equiv.settings._profiles))
    monkeypatch.setattr(equiv.settings, "_current", equiv.settings._current)
    monkeypatch.setattr(hypothesis.settings, "_profiles", dict(hypothesis.settings._profiles))
    hypothesis_profile = hypothesis.settings._current_profile
    monkeypatch.setattr(hypothesis.settings, "_current_profile", hypothesis_profile)
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{path.relative_to(ROOT)} block {i + 1}", "exec"), namespace)
        except Exception as e:  # re-raise with the block named
            raise AssertionError(f"{path.name} block {i + 1} failed: {e!r}\n{code}") from e


def test_reference_covers_every_public_name_and_check():
    """docs/reference.md names every re-exported name, every check and every failure class."""
    import equiv
    from equiv._settings import ALL_CHECKS
    from equiv._catalog import FAILURE_CLASSES

    text = (ROOT / "docs" / "reference.md").read_text()
    missing = [n for n in equiv.__all__ if f"`{n}" not in text]
    missing += [c for c in ALL_CHECKS if f"`{c}`" not in text]
    missing += sorted({c.__name__ for c in FAILURE_CLASSES.values()} - {
        n for n in equiv.__all__ if f"`{n}`" in text})
    assert not missing, f"docs/reference.md does not document: {missing}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_resolve():
    """The docs 'build': every relative link in README.md and docs/ points at a file."""
    broken = []
    for doc in documents():
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


@pytest.mark.parametrize("name", ["equivalent_to", "check"])
def test_reference_signatures_are_the_real_ones(name):
    """docs/reference.md shows equivalent_to's and check()'s real signature, every parameter."""
    import inspect

    import equiv

    sig = inspect.signature(getattr(equiv, name))
    shown = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            shown.append(f"**{p.name}")
        elif p.default is p.empty:
            shown.append(p.name)
        else:
            shown.append(f"{p.name}={p.default!r}")
    text = f"{name}({shown[0]}, *, {', '.join(shown[1:])})"
    assert f"`{text}" in (ROOT / "docs" / "reference.md").read_text()
