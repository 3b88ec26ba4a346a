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
# The whole suite on an x86-64 machine also runs the kernel-facing tests on the other builds of
# the kernels this CPU can execute: the native build compiles only its own vector paths, so the
# plain loops (CPUs without AVX2, ARM) and the AVX2 paths (AVX2 CPUs without AVX-512: Zen 3,
# many cloud VMs) would otherwise run nowhere on an AVX-512 machine (the plain loops broke twice
# unseen). Each pass also checks that its build reports the paths its target takes.
kernel_tests=(tests/test_attention.py tests/test_codecs.py tests/test_turbo.py
  tests/test_pre_rope.py tests/test_encode.py tests/test_linear.py tests/test_dense.py
  tests/test_rows.py tests/test_qlinear.py tests/test_kernel_sources.py::test_the_build_reports_the_paths_its_target_takes)
kernel_pass() {  # $1: the -march target, $2: what it builds
  echo "[test] pytest on the $2 kernels (KVCACHE_KERNEL_MARCH=$1)"
  KVCACHE_KERNEL_MARCH="$1" .venv/bin/python -m kvcache.kernels
  KVCACHE_KERNEL_MARCH="$1" .venv/bin/python -m pytest -q "${kernel_tests[@]}"
}
# what x86-64-v3 needs (gcc's definition, /proc/cpuinfo's names: abm = LZCNT, pni = SSE3)
v3_flags="avx avx2 bmi1 bmi2 f16c fma abm movbe xsave cx16 lahf_lm popcnt pni ssse3 sse4_1 sse4_2"
missing_flags() {  # the names of $@ that /proc/cpuinfo's first flags line lacks
  local have
  have=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  for f in "$@"; do [[ "$have" == *" $f "* ]] || printf '%s ' "$f"; done
}
if [ "$#" -eq 0 ] && [ "$(uname -m)" = x86_64 ] && [ -z "${KVCACHE_KERNEL_MARCH:-}" ]; then
  kernel_pass x86-64 plain-loop
  lacks="$(missing_flags $v3_flags)"
  if [ -z "$lacks" ]; then
    kernel_pass x86-64-v3 AVX2
  else
    echo "[test] skipped the AVX2 kernels (KVCACHE_KERNEL_MARCH=x86-64-v3): this CPU lacks ${lacks% }"
  fi
fi
