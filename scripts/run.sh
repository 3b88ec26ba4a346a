#!/usr/bin/env bash
# Install everything into .venv/ and run the main job: SmolLM2-135M-Instruct generation on
# the cell cache, streaming text and ending with a stats line. Arguments replace the
# defaults and go to `kvcache generate` (try: bash scripts/run.sh --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
  set -- --chat --max-new-tokens 96 --seed 0 "Explain in three sentences what a KV cache is."
fi
exec .venv/bin/kvcache generate "$@"
