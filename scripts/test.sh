#!/usr/bin/env bash
# Install everything into .venv/ and run the whole test suite: lint, types, tests.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
echo "[test] ruff"
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
echo "[test] mypy"
.venv/bin/mypy
echo "[test] pytest"
.venv/bin/python -m pytest "$@"
# The whole suite on an x86-64 machine also runs the kernel-facing tests on the kernels'
# plain-loop build, the one CPUs without AVX2 (or not x86: ARM) get: this machine's build
# compiles only its own vector paths, and the plain loops broke twice unseen.
if [ "$#" -eq 0 ] && [ "$(uname -m)" = x86_64 ] && [ -z "${KVCACHE_KERNEL_MARCH:-}" ]; then
  echo "[test] pytest on the plain-loop kernels (KVCACHE_KERNEL_MARCH=x86-64)"
  export KVCACHE_KERNEL_MARCH=x86-64
  .venv/bin/python -m kvcache.kernels
  .venv/bin/python -m pytest -q tests/test_attention.py tests/test_codecs.py tests/test_turbo.py \
    tests/test_pre_rope.py tests/test_encode.py tests/test_linear.py tests/test_dense.py \
    tests/test_rows.py
fi
