#!/usr/bin/env bash
# Install Tandem with its test extras (CPU torch first: a bare `torch` requirement would pull a
# multi-GB CUDA build) and run the whole CPU test suite on all cores.
# Any non-zero pytest code fails, including 5 ("no tests collected").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
python3 -m pytest -n auto --durations=15 "$@"
