#!/usr/bin/env bash
# Build (or reuse) a pinned test environment and link it into the checkout.
#
#   bash ci/setup_env.sh            # ci/constraints.txt         -> .venv
#   bash ci/setup_env.sh nemo273    # ci/constraints-nemo273.txt -> .venv-nemo273
#
# The environment is large (torch alone is ~5.5 GB), so it lives outside the
# checkout in a cache directory keyed by the pins, the Python version and this
# script; a fresh machine builds it from nothing (~3 min here), a second run
# only re-installs nemo_safe itself (editable, no dependencies).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
profile=${1:-}
constraints="$here/constraints${profile:+-$profile}.txt"
link="$repo/.venv${profile:+-$profile}"
python=${NEMO_SAFE_PYTHON:-python3}
cache_root=${NEMO_SAFE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo_safe}
[ -f "$constraints" ] || { echo "setup_env: no $constraints" >&2; exit 2; }

key=$( { "$python" -c 'import sys; print(sys.version)'; cat "$constraints" "$here/setup_env.sh"; } \
       | sha256sum | cut -c1-16)
venv="$cache_root/venv-$key"

if [ ! -f "$venv/.complete" ]; then
    echo "setup_env: building $venv from $(basename "$constraints") (first run on this machine or pins changed)"
    # .complete is written last, so an interrupted build is rebuilt, never reused.
    rm -rf "$venv"
    mkdir -p "$cache_root"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade "pip>=24" setuptools wheel
    # torch first: with no torch installed, a dependency's loose range could pull a newer build.
    "$venv/bin/pip" install -q -c "$constraints" torch torchvision
    # Every package the constraints file names, at its pinned version.
    mapfile -t packages < <(sed -e 's/#.*//' -e 's/[<>=~!;[ ].*//' "$constraints" | grep -v '^$')
    "$venv/bin/pip" install -q -c "$constraints" "${packages[@]}"
    # "#no-build-isolation: <package>" lines: sdists that build only against what is installed (an old NeMo's
    # youtokentome needs Cython < 3 from the environment).
    mapfile -t unisolated < <(sed -n 's/^#no-build-isolation: *//p' "$constraints")
    if [ ${#unisolated[@]} -gt 0 ]; then
        "$venv/bin/pip" install -q --no-build-isolation -c "$constraints" "${unisolated[@]}"
    fi
    touch "$venv/.complete"
else
    echo "setup_env: reusing $venv"
fi

"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo"
ln -sfn "$venv" "$link"
echo "setup_env: $(basename "$link") -> $venv"
