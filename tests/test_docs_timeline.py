"""docs/timeline.md: every ```python block runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "timeline.md"


def test_timeline_doc_code_blocks_run(capsys):
    """The walk-through's code (with its asserts) executes as written."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 6
    namespace: dict = {"__name__": "docs_timeline"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "slope = 4.0" in out
    assert "version NOT bumped: untracked write" in out
