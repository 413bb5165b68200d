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
    makes from the code today (timings aside). In a process of its own, as a user runs the command: loading the
    persistent compilation cache's executables late in this long test process has crashed XLA:CPU (a segfault
    in deserialization, not reproduced in a fresh process)."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "update_readme.py")
    proc = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
