#!/usr/bin/env bash
# Install Tandem into the project venv (.venv; CPU torch first, see scripts/lib/venv.sh) and run the
# whole suite locally: kvstore + router + one worker on embedded defaults (memory kvstore, torch
# backend on CPU, the built-in tiny model), then a demo request streamed twice (the second one hits
# the first one's cached KV). Ctrl-C stops everything.
# Extra arguments go to `tandem up` (e.g. --workers 2, --exit-after-demo).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/venv.sh
# A GPU box (TANDEM_TORCH=cuda) gets the CUDA torch and the `gpu` extra (FlashInfer) too.
ensure_venv "$([ "${TANDEM_TORCH:-cpu}" = cuda ] && echo gpu)"
echo "ready: $(dirname "$TANDEM_PY")/tandem is the CLI (or: source .venv/bin/activate)" >&2
exec "$TANDEM_PY" -m services.cli up --demo "$@"
