#!/usr/bin/env bash
# The release sweep: the release-dependent tests on every NeMo / torchvision / torch release nemo_safe claims,
# each in a real install of its own (built once and cached by ci/setup_env.sh), then the support table of docs/releases.md
# regenerated from what ran (ci/support_table.py).
#
#   bash ci/release_sweep.sh                 # every profile below (about 40 min here once the environments exist)
#   bash ci/release_sweep.sh nemo123 tv017   # some of them (what CI runs next to the main suite; no table)
#
# A profile is a ci/constraints-<profile>.txt ("main" is ci/constraints.txt). Results go to
# .sweep/<profile>.json; the table is written into docs/releases.md between its support-table markers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NEMO_PROFILES=(nemo123 nemo200 nemo233 nemo273 main)
TORCHVISION_PROFILES=(tv017 tv020 tv024 main)
profiles=("$@")
[ ${#profiles[@]} -gt 0 ] || profiles=(nemo123 nemo200 nemo233 nemo273 tv017 tv020 tv024 main)

# The release-dependent NeMo tests: the exp_manager matrix under torchrun (the resume race and its upstream twin
# among its cases), the version guard, import orders, one process, NeMo 2.x's NeMoLogger path (skipped where NeMo
# has none). The fault cases and the srun/node-local/restart runs exercise nemo_safe's own code, identical on every
# release: they run once, on main. NeMo's own downloads: 8 ranks' from_pretrained and its twin, one process's
# refresh, the Megatron files (skipped where NeMo keeps them elsewhere); their fault cases run on main only, although
# 1.23 to 2.7.3 download through wget (a gap, said in docs/nemo.md).
NEMO_TESTS=(tests/test_nemo_exp_manager.py tests/test_exp_manager_matrix.py tests/test_nemo_logger_path.py
    tests/test_nemo_downloads.py)
NEMO_K="not demo_command and not local_launcher and not killed and not read_only and not disagree \
and not srun_two_nodes and not node_local and not node_copies and not restart and not train_then_resume \
and not broken_download and not refresh_cache"
# The release-dependent torchvision / torch.hub tests: MNIST's race and its twin, one more dataset family (CIFAR10,
# SVHN, Omniglot, OxfordIIITPet), hub weights and their twin, each gate's verdict, patch and unpatch.
TORCHVISION_TESTS=(tests/test_torchvision_downloads.py tests/test_torchvision_datasets.py tests/test_torch_hub.py)
TORCHVISION_K="spawn_eight_ranks or upstream_twin or every_mnist or every_covered or unpatch_restores or version_gate"

contains() { local x; for x in "${@:2}"; do [ "$x" = "$1" ] && return 0; done; return 1; }

mkdir -p .sweep
status=0
for profile in "${profiles[@]}"; do
    if [ "$profile" = main ]; then venv=.venv; bash ci/setup_env.sh; else venv=.venv-$profile; bash ci/setup_env.sh "$profile"; fi
    args=()
    contains "$profile" "${NEMO_PROFILES[@]}" && args+=(nemo)
    contains "$profile" "${TORCHVISION_PROFILES[@]}" && args+=(torchvision)
    echo "release_sweep: $profile (${args[*]}) ($(date +%T))"
    result=0
    for part in "${args[@]}"; do
        if [ "$part" = nemo ]; then tests=("${NEMO_TESTS[@]}"); k=$NEMO_K; else tests=("${TORCHVISION_TESTS[@]}"); k=$TORCHVISION_K; fi
        "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" -k "$k" \
            --junitxml ".sweep/$profile-$part.xml" || result=$?
    done
    "$venv/bin/python" ci/support_table.py record "$profile" "${args[@]}" --exit "$result"
    [ "$result" = 0 ] || status=$result
done
# The table only from a whole sweep: a partial one (CI's) would drop the other releases' rows. A whole sweep also
# verifies the upstream series on their older releases (CI verifies them on the newest).
if [ $# -eq 0 ]; then
    .venv/bin/python ci/support_table.py write docs/releases.md
    echo "release_sweep: upstream series on their older releases ($(date +%T))"
    .venv/bin/python ci/verify_patches.py --which older || status=$?
fi
exit "$status"
