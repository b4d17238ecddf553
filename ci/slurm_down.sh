#!/usr/bin/env bash
# Stop the local test cluster started by ci/slurm_up.sh (slurmd x2, slurmctld, munged).
set -uo pipefail
pkill -x slurmd 2>/dev/null
pkill -x slurmctld 2>/dev/null
for _ in $(seq 50); do
    pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break
    sleep 0.1
done
pkill -x munged 2>/dev/null
echo "slurm_down: stopped"
exit 0
