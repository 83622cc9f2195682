#!/usr/bin/env bash
# Create .venv with Python >= 3.12 (3.12 preferred: the GPU machine runs 3.12) and install v41jax with its dev extra.
# Usage: bash scripts/setup.sh            (idempotent; re-running only re-checks the install)
# Env:   V41JAX_PYTHON=/path/to/python3.12 to choose the interpreter yourself.
set -euo pipefail
cd "$(dirname "$0")/.."

is_ok() {  # is "$@" a Python >= 3.12?
  "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  if [ -n "${V41JAX_PYTHON:-}" ]; then
    is_ok "$V41JAX_PYTHON" && { echo "$V41JAX_PYTHON"; return; }
    echo "V41JAX_PYTHON=$V41JAX_PYTHON is not a Python >= 3.12" >&2; exit 1
  fi
  for name in python3.12 python3.13 python3.14 python3 python; do
    if command -v "$name" >/dev/null 2>&1 && is_ok "$name"; then command -v "$name"; return; fi
  done
  # pyenv keeps interpreters that its shims hide unless PYENV_VERSION names them.
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.[0-9]+)?$' | sort -V); do
      p="$(pyenv root)/versions/$v/bin/python3"
      if [ -x "$p" ] && is_ok "$p"; then echo "$p"; return; fi
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_ok .venv/bin/python; then
  if ! py="$(find_python)"; then
    cat >&2 <<'MSG'
error: v41jax needs Python >= 3.12 (jax 0.11 supports nothing older), and none was found
on PATH (python3.12, python3.13, python3) or under pyenv.
Install one, for example:  pyenv install 3.12   or   apt-get install python3.12 python3.12-venv
then re-run this script (or set V41JAX_PYTHON=/path/to/python3.12).
MSG
    exit 1
  fi
  echo "setup: creating .venv with $py ($("$py" --version 2>&1))"
  rm -rf .venv
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
echo "setup: ready ($(.venv/bin/python --version), jax $(.venv/bin/python -c 'import jax; print(jax.__version__)'))"
