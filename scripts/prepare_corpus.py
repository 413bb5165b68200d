"""Extract the King James Bible from Debian's `bible-kjv` packages into a clean train/valid text corpus.

Source: Debian package `bible-kjv-text` (compressed text in /usr/lib/bible.data), read with the `bible` program
from package `bible-kjv` (both version 4.38 in Debian bookworm). The KJV text is in the public domain; see
docs/default_model_data.md for provenance and licensing.

Output format (one document per chapter, documents separated by exactly one blank line):

    Genesis 1
    In the beginning God created the heaven and the earth.
    And the earth was without form, and void; ...

    Genesis 2
    ...

The first line of a chapter is its heading ("<Book> <chapter>"); each following line is one verse with its verse
number removed and whitespace normalised. Chapters are numbered 0..1188 in canonical order; every chapter whose
index i satisfies i % every == every - 1 (default every = 50, i.e. 23 chapters, ~2%) goes to valid.txt, the rest to
train.txt. The procedure is fully deterministic.

Usage: python scripts/prepare_corpus.py [--out-dir data/corpus] [--every 50]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys

# The corpus lives inside the repository (data/ is gitignored), wherever the script is run from.
CORPUS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "corpus")

PACKAGES = ("bible-kjv", "bible-kjv-text")
DATA_FILE = "/usr/lib/bible.data"
VERSE_RANGE = "Gen1:1-Rev22:21"  # the whole Bible (NB: "Rev22" alone would mean Rev 22:1 only)
N_CHAPTERS, N_VERSES = 1189, 31102  # canonical KJV (Protestant canon) counts, used as a sanity check

VERSE_RE = re.compile(r"^\s+(\d+) (.*)$")


def ensure_packages(bible_bin: str) -> str:
    """Return the path of the `bible` reader, installing the Debian packages with apt-get if needed."""
    path = shutil.which(bible_bin)
    if path and os.path.exists(DATA_FILE):
        return path
    print(f"`{bible_bin}` or {DATA_FILE} missing; trying: apt-get install -y {' '.join(PACKAGES)}", file=sys.stderr)
    apt = shutil.which("apt-get")
    if apt is None:
        sys.exit(f"error: apt-get not found; install the Debian packages {PACKAGES} (version 4.38) by hand")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    rc = subprocess.call([apt, "install", "-y", *PACKAGES], env=env)
    if rc != 0:
        rc = subprocess.call([apt, "update"], env=env) or subprocess.call([apt, "install", "-y", *PACKAGES], env=env)
    path = shutil.which(bible_bin)
    if rc != 0 or path is None or not os.path.exists(DATA_FILE):
        sys.exit(f"error: could not install {PACKAGES} (need root and access to a Debian mirror); "
                 f"run `apt-get install {' '.join(PACKAGES)}` yourself and retry")
    return path


def read_chapters(bible: str) -> list[list[str]]:
    """Dump the whole text with `bible` (no line wrapping) and parse it into [heading, verse, verse, ...] lists."""
    raw = subprocess.run([bible, "-l1000000", VERSE_RANGE], check=True, capture_output=True, text=True).stdout
    chapters: list[list[str]] = []
    expected = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        m = VERSE_RE.match(line)
        if m is None:  # chapter heading, e.g. "1 Samuel 3"
            chapters.append([" ".join(line.split())])
            expected = 1
            continue
        if not chapters or int(m.group(1)) != expected:
            raise ValueError(f"unexpected verse numbering at: {line[:80]!r}")
        chapters[-1].append(" ".join(m.group(2).split()))
        expected += 1
    n_verses = sum(len(c) - 1 for c in chapters)
    if (len(chapters), n_verses) != (N_CHAPTERS, N_VERSES):
        raise ValueError(f"got {len(chapters)} chapters / {n_verses} verses, expected {N_CHAPTERS} / {N_VERSES}")
    return chapters


def write(path: str, chapters: list[list[str]]) -> None:
    text = "\n\n".join("\n".join(c) for c in chapters) + "\n"
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    print(f"{path}: {len(chapters)} chapters, {sum(len(c) - 1 for c in chapters)} verses, "
          f"{len(text.split())} words, {len(text)} chars, sha256 {sha[:16]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=CORPUS_DIR, help="where train.txt and valid.txt are written")
    ap.add_argument("--every", type=int, default=50, help="every N-th chapter (index %% N == N-1) goes to valid")
    ap.add_argument("--bible-bin", default="bible", help="the reader program from package bible-kjv")
    args = ap.parse_args()

    chapters = read_chapters(ensure_packages(args.bible_bin))
    train = [c for i, c in enumerate(chapters) if i % args.every != args.every - 1]
    valid = [c for i, c in enumerate(chapters) if i % args.every == args.every - 1]
    os.makedirs(args.out_dir, exist_ok=True)
    write(os.path.join(args.out_dir, "train.txt"), train)
    write(os.path.join(args.out_dir, "valid.txt"), valid)
    print("valid chapters:", ", ".join(c[0] for c in valid))


if __name__ == "__main__":
    main()
