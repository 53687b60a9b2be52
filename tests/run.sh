#!/usr/bin/env bash
# Runs the suite; pytest's exit 5 ("no tests collected") counts as a failure.
#   tests/run.sh          make test: every tier, fast to slow, without the `slow` soak runs
#   tests/run.sh --all    make test-all: the same plus the `slow` ones
#   tests/run.sh ARGS...  plain pytest arguments
set -uo pipefail
cd "$(dirname "$0")/.."
# Fast to slow: unit (no Ray, no subprocess), integration (a private local Ray), e2e (a cluster).
TIERS=(tests/unit tests/integration tests/e2e)
if [ "$#" -eq 0 ]; then
  set -- -m "not slow" "${TIERS[@]}"
elif [ "$1" = "--all" ]; then
  set -- "${TIERS[@]}"
fi
.venv/bin/python -m pytest --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
