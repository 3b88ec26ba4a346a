#!/usr/bin/env bash
# Install everything into .venv/ and run the main job. Extra arguments go to the command.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
exec .venv/bin/kvcache demo "$@"
