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
