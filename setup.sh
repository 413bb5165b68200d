#!/usr/bin/env bash
# Create .venv with Python >= 3.12 and install dsv4_jax (editable) with its test and bench extras (and jax's CUDA
# build where nvidia-smi finds a GPU).
set -euo pipefail
cd "$(dirname "$0")"
find_python() {
    for cand in python3.12 python3.13 python3; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
            echo "$cand"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -rV); do
            if PYENV_VERSION="$v" python3 -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
                echo "env PYENV_VERSION=$v python3"; return 0
            fi
        done
    fi
    return 1
}
PY=$(find_python) || { echo "setup.sh: no Python >= 3.12 found (tried python3.12, python3.13, python3, pyenv)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
    $PY -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
EXTRAS="test,bench,serve"
# A machine with an NVIDIA GPU gets the CUDA build of jax (the `cuda` extra), so the same two commands serve it.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    EXTRAS="test,bench,serve,cuda"
    echo "setup.sh: NVIDIA GPU found ($(nvidia-smi -L | head -1)); installing jax's CUDA build"
fi
.venv/bin/python -m pip install -q -e ".[$EXTRAS]"
echo "setup.sh: ready (.venv/bin/python $(.venv/bin/python -c 'import sys; print(sys.version.split()[0])'))"
