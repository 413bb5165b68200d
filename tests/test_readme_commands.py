"""Every command in the README's shell blocks runs as written.

Each command line of a ```bash block is checked by what it names:
- `./setup.sh`, `bash X.sh`: the script exists and bash parses it;
- the test command: it is what CI runs (`.ci/run`);
- `python -m MODULE ARGS` and `python scripts/X.py ARGS` (also `.venv/bin/python`, `python3`, with leading
  environment assignments): the module or script exists and its own argument parsing accepts ARGS as written
  (a module's `parse_args(argv)` where it has one, so its checks after argparse run too; argparse's alone for one
  without, e.g. the server, whose later checks need a model); nothing else of it runs;
- the commands of RUN_FOR_REAL, which need no GPU, checkpoint or terminal, also run to completion (in a process of
  their own, as a user runs them; see test_readme.py for why not in this one; `-m slow`).
A command no rule covers fails the test, so a new kind of command in the README gets a rule here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
README = os.path.join(ROOT, "README.md")
PYTHONS = {".venv/bin/python", "python", "python3"}
# Commands that run for real: the default model on the CPU, a few seconds each once the first has compiled.
RUN_FOR_REAL = [
    ".venv/bin/python -m dsv4_jax.generate",
    '.venv/bin/python -m dsv4_jax.generate --prompt "The capital of France" --max-new-tokens 32',
    '.venv/bin/python -m dsv4_jax.generate --chat --prompt "Who was the first king of Israel?" --temperature 0',
]


def readme_commands() -> list[str]:
    """The command lines of the README's bash blocks: continuation lines joined, comments and blank lines dropped."""
    with open(README) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


class _Parsed(Exception):
    """Raised in place of running a program once its arguments were accepted."""


def _stop_after_parsing(monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed()
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)


def _check_arguments(target: list[str], argv: list[str], monkeypatch):
    """`target` is ["-m", module] or [path]: its argument parsing must accept argv (SystemExit 2 otherwise)."""
    if target[0] == "-m":
        module_name = target[1]
        main_module = module_name + ".__main__" if importlib.util.find_spec(module_name).submodule_search_locations \
            else module_name
        module = importlib.import_module(main_module)
        if hasattr(module, "parse_args"):
            module.parse_args(argv)
            return
        _stop_after_parsing(monkeypatch)
        with pytest.raises(_Parsed):
            module.main(argv)
        return
    path = os.path.join(ROOT, target[0])
    assert os.path.isfile(path), f"the README runs {target[0]}, which does not exist"
    _stop_after_parsing(monkeypatch)
    monkeypatch.setattr(sys, "argv", [path] + argv)
    monkeypatch.syspath_prepend(os.path.dirname(path))          # as `python path` puts the script's folder first
    with pytest.raises(_Parsed):
        runpy.run_path(path, run_name="__main__")


def test_the_readme_has_commands():
    commands = readme_commands()
    assert len(commands) >= 8
    as_words = [shlex.split(c) for c in commands]
    missing = [c for c in RUN_FOR_REAL if shlex.split(c) not in as_words]
    assert not missing, f"RUN_FOR_REAL names commands the README no longer has: {missing}"


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_is_valid(command, monkeypatch):
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):       # FOO=1 python ...
        words = words[1:]
    program, args = words[0], words[1:]
    if program == "./setup.sh" or program == "bash":
        script = os.path.join(ROOT, "setup.sh" if program == "./setup.sh" else args[0])
        assert os.path.isfile(script), f"{command}: no such script"
        assert subprocess.run(["bash", "-n", script]).returncode == 0, f"{command}: bash cannot parse it"
        return
    assert program in PYTHONS, f"no rule checks the README command {command!r}: add one to this test"
    if args[:2] == ["-m", "pytest"]:
        with open(os.path.join(ROOT, ".ci", "run")) as f:
            assert command in f.read().splitlines(), "the README's test command is not the one CI runs"
        return
    target, argv = (args[:2], args[2:]) if args[0] == "-m" else (args[:1], args[1:])
    monkeypatch.chdir(ROOT)
    _check_arguments(target, argv, monkeypatch)


@pytest.mark.slow
def test_readme_commands_run_for_real(tmp_path):
    """The quick start and the command line's first examples, run through the CLI's entry point in one process
    (`slow`: in CI, test_readme.py's check of the real-output block runs the same entry point on the default
    model, and the arguments of these commands are checked above)."""
    argvs = [shlex.split(c)[3:] for c in RUN_FOR_REAL]
    driver = ("import sys\nfrom dsv4_jax.generate import main\n"
              f"for argv in {argvs!r}:\n"
              "    code = main(argv)\n"
              "    print('EXIT', code, flush=True)\n"
              "    assert code == 0, argv\n")
    proc = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("EXIT 0") == len(RUN_FOR_REAL)
    assert "The capital of France" in proc.stdout          # plain mode echoes the prompt before its continuation
