#!/usr/bin/env bash
# Wheel smoke test (run by .ci/run): build numatp's wheel, install it with the dependency floors of
# scripts/floors.txt into a fresh virtual environment (not editable), and run scripts/wheel_smoke.py there
# from outside the source tree with an empty cache, so the C++ library is built from the installed files.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# built from a copy of the files git knows (tracked, or new and not ignored): no earlier build/ output
# can slip into the wheel and hide a file that package-data misses
mkdir "$work/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | tar -C "$repo" --null -T - --ignore-failed-read -cf - | tar -C "$work/src" -xf -
pip wheel --no-deps --quiet "$work/src" -w "$work/dist"
wheel=("$work"/dist/numatp-*.whl)
python -m venv "$work/venv"
# the floors pinned exactly: the versions pyproject's lower bounds promise to work with
"$work/venv/bin/pip" install --quiet --constraint "$repo/scripts/floors.txt" "${wheel[0]}" torch transformers
mkdir "$work/cache" "$work/run"
cd "$work/run"
env -u PYTHONPATH NUMATP_CACHE_DIR="$work/cache" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    "$work/venv/bin/python" "$repo/scripts/wheel_smoke.py" "$repo"
