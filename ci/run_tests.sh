#!/usr/bin/env bash
# The whole test suite from a fresh machine: system packages, the pinned
# environments (.venv with nemo_toolkit 3.0.0; the release sweep's oldest, .venv-nemo123
# and .venv-tv017; .venv-nemo273 for NeMo 2.x's NeMoLogger path), the local two-node
# SLURM cluster, lint, then pytest: everything on .venv, the release-dependent tests on
# the oldest releases; then the upstream patch series (patches/): regenerated and
# compared right after lint, applied to the pristine releases and tested at the end.
# Extra arguments go to pytest (e.g. `bash ci/run_tests.sh -k slurm`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
step() { echo "run_tests: $* ($(date +%T))"; }

need=()
command -v bindfs >/dev/null 2>&1 || need+=(bindfs)
command -v fusermount3 >/dev/null 2>&1 || command -v fusermount >/dev/null 2>&1 || need+=(fuse3)
if [ ${#need[@]} -gt 0 ]; then
    echo "run_tests: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

bash ci/setup_env.sh
bash ci/setup_env.sh nemo273
bash ci/setup_env.sh nemo123
bash ci/setup_env.sh tv017

started_cluster=0
if ! sinfo -h >/dev/null 2>&1; then
    started_cluster=1
fi
bash ci/slurm_up.sh
if [ "$started_cluster" = 1 ]; then
    trap 'bash ci/slurm_down.sh' EXIT
fi

step "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

step "upstream patch series are what the code generates"
.venv/bin/python ci/make_patches.py --check

step "pytest (nemo_toolkit 3.0.0), two test files at a time"
# Two pytest-xdist workers, each file on one of them (module fixtures such as the matrix's launches run once; a
# file's tests never overlap each other). The suite spends ~45% of its time waiting (start skews, throttled
# servers, timeouts), so two at a time fill that idle time (27-30 instead of 45 min here). The tests' time bounds are
# hang guards or relative to runs measured in the same test, sized for 8 NeMo ranks on 2 cores: a busier machine
# makes tests slower (1.0-2.4x each, measured), not different.
.venv/bin/python -m pytest tests -n 2 --dist loadfile --durations=25 "$@"
step "release sweep, oldest releases (nemo_toolkit 1.23.0; torchvision 0.17.2 with torch 2.2.2)"
# The release-dependent tests (ci/release_sweep.sh says which) on the oldest releases the sweep covers; the newest
# are the main suite above. nemo_toolkit 2.7.3's check_resume and get_log_dir are 3.0.0's byte for byte.
# (Extra arguments are pytest's: the sweep runs its own selection.)
bash ci/release_sweep.sh nemo123 tv017
step "NeMo 2.x's NeMoLogger path (nemo_toolkit 2.7.3; NeMo 3.0 has none)"
status=0
.venv-nemo273/bin/python -m pytest -q tests/test_nemo_logger_path.py "$@" || status=$?
# 5 (no test collected) only where extra arguments deselected every test. (An explicit exit: set -e does not stop
# at a failing `a || { b && c; }`.)
if [ "$status" != 0 ] && ! { [ "$status" = 5 ] && [ $# -gt 0 ]; }; then
    exit "$status"
fi

step "upstream patch series on their newest pristine releases, nemo_safe not imported"
# (The older releases a series is verified on, nemo_toolkit 2.7.3, run with the release sweep.)
.venv/bin/python ci/verify_patches.py --which newest
step "done"
