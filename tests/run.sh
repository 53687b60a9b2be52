#!/usr/bin/env bash
# Runs the whole suite; pytest's exit 5 ("no tests collected") counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
# Fast to slow: unit (no Ray), integration (a private local Ray), e2e (a real cluster).
if [ "$#" -eq 0 ]; then set -- tests/unit tests/integration tests/e2e; fi
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
