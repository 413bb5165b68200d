"""Build the CUDA sources of ffi/ once per (source + header hash, GPU architecture, nvcc) and register their XLA FFI handlers.

    library = build_library("fp4_gemv.cu", arch="sm_90a")       # path of the cached .so (compiles on first use)
    register("fp4_gemv.cu", {"dsv4_mxfp4_gemv": "DSV4Mxfp4Gemv"})
    register("/abs/path/probe.cu", {...})     # a source outside the package (a probe) may include ffi/'s files

The cache lives in $DSV4_JAX_FFI_CACHE (default ~/.cache/dsv4_jax/ffi); a finished library is renamed into place
atomically, so concurrent builders never load a half-written file. Libraries are built where they run (a library
built on another machine may need other system libraries), with nvcc from PATH or $CUDA_HOME/bin.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import jax

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
_registered: set[str] = set()


class FfiBuildError(RuntimeError):
    """nvcc is missing or the CUDA source does not compile."""


def _nvcc() -> str:
    found = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(found):
        raise FfiBuildError("nvcc not found (PATH or $CUDA_HOME/bin): the FFI CUDA kernels are compiled on first use")
    return found


def device_arch(device=None) -> str:
    """sm_XY(a) of `device` (default: JAX's first GPU; a compile-only device of a jax.experimental.topologies
    topology works too) ('a' for Hopper's architecture-specific features)."""
    device = jax.devices("gpu")[0] if device is None else device
    major, minor = str(device.compute_capability).split(".")
    return f"sm_{major}{minor}" + ("a" if major == "9" else "")


def _included_sources(path: str) -> list[str]:
    """The .cu files of ffi/ that the source at `path` includes (a diagnostic build includes a kernel's source whole);
    headers are hashed anyway."""
    with open(path) as f:
        return re.findall(r'^#include "([^"]+\.cu)"', f.read(), re.M)


def build_library(source: str, arch: str | None = None, cache_dir: str | None = None) -> str:
    """Path of the shared library for ffi/<source> (or a source at an absolute path, built with ffi/ on its include
    path) on `arch`, compiling it if this exact build is not cached."""
    arch = arch or device_arch()
    path = source if os.path.isabs(source) else os.path.join(SOURCE_DIR, source)
    source = os.path.basename(path)
    hashed = [path] + [os.path.join(SOURCE_DIR, name) for name in _included_sources(path)]
    hashed += [os.path.join(SOURCE_DIR, f) for f in sorted(os.listdir(SOURCE_DIR)) if f.endswith(".cuh")]
    code = b""
    for name in hashed:
        with open(name, "rb") as f:
            code += f.read()
    nvcc = _nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(code + arch.encode() + version.encode() + jax.ffi.include_dir().encode()).hexdigest()[:16]
    cache_dir = cache_dir or os.environ.get("DSV4_JAX_FFI_CACHE",
                                            os.path.join(os.path.expanduser("~"), ".cache", "dsv4_jax", "ffi"))
    os.makedirs(cache_dir, exist_ok=True)
    target = os.path.join(cache_dir, f"{os.path.splitext(source)[0]}_{arch}_{key}.so")
    if os.path.exists(target):
        return target
    compute = arch.replace("sm_", "compute_")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch={compute},code={arch}",
           "-isystem", jax.ffi.include_dir(), "-I", SOURCE_DIR, "-o", tmp, path]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        raise FfiBuildError(f"nvcc failed on {source} for {arch}:\n{result.stderr.strip()}")
    os.replace(tmp, target)
    return target


def register(source: str, handlers: dict[str, str], arch: str | None = None) -> None:
    """Build (if needed) and load ffi/<source> (or a source at an absolute path) for `arch` (default: this process's
    GPU), and register its handler symbols as XLA FFI targets for CUDA under the given names; once per process."""
    if all(name in _registered for name in handlers):
        return
    library = ctypes.cdll.LoadLibrary(build_library(source, arch))
    for name, symbol in handlers.items():
        if name not in _registered:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="CUDA")
            _registered.add(name)
