"""Every Python block of the README runs as written on the CPU (the packaged default model stands in wherever a
block names no checkpoint)."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _python_blocks() -> list[str]:
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_readme_has_python_blocks():
    assert len(_python_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_block_runs(index, capsys):
    code = _python_blocks()[index]
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": f"readme_block_{index}"})


def test_generated_blocks_match_the_live_code():
    """The CLI synopsis and the default model's real output in the README are what scripts/update_readme.py
    makes from the code today (timings aside)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import update_readme
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    assert update_readme.drifted(readme, update_readme.blocks()) == [], "run python scripts/update_readme.py"
