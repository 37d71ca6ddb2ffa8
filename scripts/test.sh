#!/usr/bin/env bash
# Install Tandem with its test extras into the project venv (.venv; CPU torch first, see
# scripts/lib/venv.sh) and redis-server (the Redis backend tests start real ones; apt-get where
# missing), and run the whole CPU test suite on all cores. Extra arguments go to pytest.
# Any non-zero pytest code fails, including 5 ("no tests collected").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/venv.sh
ensure_venv test
ensure_redis_server
exec "$TANDEM_PY" -m pytest -n auto --durations=15 "$@"
