"""A digest of this package's code, so that a result names the code that ran: the model benchmark's JSON, the kernel
benchmarks' records and the server's /health (which the load test records) carry it. A default chosen in code (a
kernel a plan takes, a tiling) changes the programs as much as an option does, and a GPU machine's copy of the tree
has no git history to ask.
"""

from __future__ import annotations

import functools
import hashlib
import os

SOURCE_SUFFIXES = (".py", ".cu", ".cuh")


def source_digest(root: str | None = None) -> dict:
    """{"sha256", "files"}: a digest of every .py / .cu / .cuh file under `root` (default: this package), by relative
    path and content, in sorted order; __pycache__ is left out."""
    return dict(_package_digest()) if root is None else _digest(root)


@functools.cache
def _package_digest() -> dict:
    return _digest(os.path.dirname(os.path.abspath(__file__)))


def _digest(root: str) -> dict:
    digest, files = hashlib.sha256(), 0
    for folder, subfolders, names in os.walk(root):        # top-down: the sorted folders set the order below
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(n for n in names if n.endswith(SOURCE_SUFFIXES)):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
            files += 1
    return {"sha256": digest.hexdigest(), "files": files}
