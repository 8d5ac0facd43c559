#!/usr/bin/env bash
# The test command of README.md and .ci/run: the host suite. pyproject's addopts deselect the
# `numa` (multi-node guest, see scripts/numa-suite.sh) and `slow` tiers. Extra args go to pytest; a `-m`
# among them replaces addopts' (pytest keeps the last): `scripts/test.sh -m slow` runs the slow tier.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# One OpenMP thread unless told otherwise: tests check results, not speed, and must not oversubscribe.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q "$@"
