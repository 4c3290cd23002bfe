"""README.md says only what runs: every ```python block in it executes without error, in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code):
    # dont_inherit: the block runs as a user runs it, without this file's `from __future__` imports
    exec(compile(code, "README.md", "exec", dont_inherit=True), {"__name__": "__readme__"})


def test_readme_opens_with_the_install_and_test_commands():
    first_block = re.search(r"^```bash\n(.*?)^```$", README.read_text(encoding="utf-8"), flags=re.S | re.M).group(1)
    assert first_block.splitlines() == [
        'pip install torch==2.13.0 -e ".[test]" && python -m minidp demo',
        "python -m pytest -q",
    ]
