#!/usr/bin/env bash
# Build (or reuse) the pinned test environment and link it as .venv in the checkout.
#
# The environment is large (torch alone is ~5.5 GB), so it lives outside the
# checkout in a cache directory keyed by the pins, the Python version and this
# script; a fresh machine builds it from nothing, a second run is a no-op
# apart from re-installing nemo_safe itself (editable, no dependencies).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
python=${NEMO_SAFE_PYTHON:-python3}
cache_root=${NEMO_SAFE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo_safe}

key=$( { "$python" -c 'import sys; print(sys.version)'; cat "$here/constraints.txt" "$here/setup_env.sh"; } \
       | sha256sum | cut -c1-16)
venv="$cache_root/venv-$key"

if [ ! -f "$venv/.complete" ]; then
    echo "setup_env: building $venv (first run on this machine or pins changed)"
    # .complete is written last, so an interrupted build is rebuilt, never reused.
    rm -rf "$venv"
    mkdir -p "$cache_root"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade "pip>=24" setuptools wheel
    # torch first: with no torch installed, a dependency's loose range could pull a newer build.
    "$venv/bin/pip" install -q -c "$here/constraints.txt" torch torchvision
    "$venv/bin/pip" install -q -c "$here/constraints.txt" \
        nemo_toolkit lightning hydra-core omegaconf nv_one_logger_core \
        nv_one_logger_training_telemetry nv_one_logger_pytorch_lightning_integration \
        einops transformers sentencepiece pandas pytest ruff
    touch "$venv/.complete"
else
    echo "setup_env: reusing $venv"
fi

"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo"
ln -sfn "$venv" "$repo/.venv"
echo "setup_env: .venv -> $venv"
