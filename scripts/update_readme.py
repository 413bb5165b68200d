"""Regenerate the README's blocks that come from the live code: the command-line synopsis (from the CLI's own
parser) and the real output of the default model. `--check` only compares (tests/test_readme.py runs it).

    python scripts/update_readme.py            # rewrite the blocks in README.md
    python scripts/update_readme.py --check    # exit 1 and name the block that drifted

A block sits between `<!-- begin NAME (scripts/update_readme.py) -->` and `<!-- end NAME -->`. The real output is
the stdout of REAL_OUTPUT_COMMAND (float32, so the sampled text is the same on every CPU: bf16 roundings can differ
between instruction sets) and its statistics line from stderr, whose timings --check does not compare.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
REAL_OUTPUT_ARGS = ["--max-new-tokens", "40", "--dtype", "float32"]
REAL_OUTPUT_COMMAND = "python -m dsv4_jax.generate " + " ".join(REAL_OUTPUT_ARGS)
WIDTH = 116


def _option_text(action) -> str:
    name = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
    if action.nargs == 0:
        return name
    if action.choices:
        return f"{name} {'|'.join(str(c) for c in action.choices)}"
    return f"{name} {action.metavar or action.dest.upper()}"


def synopsis() -> str:
    """Every option of the CLI, grouped as its --help groups them."""
    sys.path.insert(0, REPO)
    from dsv4_jax.generate import PROG, build_parser
    parser = build_parser()
    lines = []
    for group in parser._action_groups:
        # An option and its value never part at a line break (a no-break space until wrapped).
        options = [f"[{_option_text(a)}]".replace(" ", "\u00a0") for a in group._group_actions
                   if a.option_strings and a.dest != "help"]
        if options:
            wrapped = textwrap.wrap(f"{group.title}: " + " ".join(options), WIDTH, subsequent_indent="    ",
                                    break_on_hyphens=False, break_long_words=False)
            lines += [line.replace("\u00a0", " ") for line in wrapped]
    return "\n".join([f"{PROG} [options]       (python -m dsv4_jax is the same command)"] + lines)


def real_output() -> tuple[str, str]:
    """(stdout, the statistics line of stderr) of REAL_OUTPUT_COMMAND, run in this process."""
    sys.path.insert(0, REPO)
    from dsv4_jax.generate import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(REAL_OUTPUT_ARGS)
    if status != 0:
        raise RuntimeError(f"{REAL_OUTPUT_COMMAND} exited {status}: {err.getvalue().strip()}")
    stats = [line for line in err.getvalue().splitlines() if line.startswith("prompt tokens:")]
    return out.getvalue().rstrip("\n"), stats[-1]


def blocks() -> dict[str, str]:
    stdout, stats = real_output()
    return {
        "cli-synopsis": f"```\n{synopsis()}\n```",
        "real-output": f"Real output of `{REAL_OUTPUT_COMMAND}` (the defaults otherwise: temperature 0.6, top-p "
                       f"0.95, seed 0)\non the 2-core CPU machine, compilation cache warm:\n\n```\n{stdout}\n```\n"
                       f"stderr: `{stats}`",
    }


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- begin {name} \(scripts/update_readme.py\) -->\n)(.*?)(<!-- end {name} -->)", re.S)


def _without_timings(text: str) -> str:
    """The statistics line with its measured numbers (seconds, tokens/s) left out."""
    return re.sub(r"\d+\.\d+ (s|tokens/s)", "<t> \\1", text)


def drifted(readme: str, generated: dict[str, str]) -> list[str]:
    """Names of the blocks whose README text differs from the live code's (timings aside)."""
    names = []
    for name, text in generated.items():
        match = _pattern(name).search(readme)
        if match is None or _without_timings(match.group(2)) != _without_timings(text + "\n"):
            names.append(name)
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 when a block drifted")
    args = ap.parse_args(argv)
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    generated = blocks()
    if args.check:
        stale = drifted(readme, generated)
        for name in stale:
            print(f"README.md block {name!r} differs from the live code: run python scripts/update_readme.py",
                  file=sys.stderr)
        return 1 if stale else 0
    for name, text in generated.items():
        if not _pattern(name).search(readme):
            raise SystemExit(f"README.md has no block {name!r} (<!-- begin {name} (scripts/update_readme.py) -->)")
        readme = _pattern(name).sub(lambda m: m.group(1) + text + "\n" + m.group(3), readme)
    with open(README, "w", encoding="utf-8") as f:
        f.write(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
