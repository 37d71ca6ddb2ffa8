#!/usr/bin/env bash
# Install Tandem (CPU torch first) and run the whole suite locally: kvstore + router + one worker
# on embedded defaults (memory kvstore, torch backend on CPU, the built-in tiny model), then a demo
# request streamed twice (the second one hits the first one's cached KV). Ctrl-C stops everything.
# Extra arguments go to `tandem up` (e.g. --workers 2, --exit-after-demo).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e .
exec python3 -m services.cli up --demo "$@"
