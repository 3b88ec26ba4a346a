#!/usr/bin/env bash
# N kvcache serve replicas + Redis + sglang-router on loopback, started and stopped together.
#   bash scripts/deploy.sh up --replicas 2 --port 8000 --policy cache_aware [-- serve options]
#   bash scripts/deploy.sh up --replicas 2 --detach ...   then   bash scripts/deploy.sh down
# (python -m kvcache.deploy --help for every option)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "$root/.venv/bin/python" -m kvcache.deploy "$@"
