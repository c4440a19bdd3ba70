"""Every python code block in docs/modes.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "modes.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_has_code_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_code_block_runs(index):
    code = BLOCKS[index]
    namespace = {"__name__": f"docs_modes_block_{index}"}
    exec(compile(code, f"docs/modes.md[block {index}]", "exec"), namespace)
