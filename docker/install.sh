#!/usr/bin/env bash
# Install megatron-core and megatron-sat into an environment that already has torch, without touching its torch
# (nor triton, Transformer Engine, Apex, flash-attn or the nvidia-* libraries a GPU container ships).
#
#   bash docker/install.sh                                  # what docker/Dockerfile runs (extras hf,train,eval)
#   PYTHON=/path/to/venv/bin/python bash docker/install.sh  # any venv or conda env with torch in it
#   MSAT_EXTRAS=dev MSAT_EDITABLE=1 bash docker/install.sh  # the development install (`make venv` runs this)
#
# Settings (environment): PYTHON (default python3), MSAT_EXTRAS (comma-separated extras of pyproject.toml, default
# hf,train,eval), MSAT_EDITABLE=1 for an editable install, MSAT_SOURCE (what to install: this source tree, the
# default, or a wheel built from it), MCORE_VERSION (default 0.19.2), PIP_CONSTRAINT (more pins; kept).
# How: every installed package of that list is pinned to its installed version through a constraints file, so pip
# either keeps it or fails, never replaces it. On Python 3.11, megatron-core 0.19.x is installed first past its
# Requires-Python (its wheels declare Python>=3.12 although its cp311 wheel works).
set -euo pipefail
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
extras=${MSAT_EXTRAS-hf,train,eval}
die() { echo "docker/install.sh: error: $*" >&2; exit 2; }

[ -f "$src/pyproject.toml" ] || die "$src is not a megatron-sat source tree"
command -v "$PYTHON" >/dev/null || die "no Python at PYTHON=$PYTHON"
before=$("$PYTHON" -c "import torch; print(torch.__version__, torch.__file__)" 2>/dev/null) \
    || die "torch does not import with $PYTHON: install torch first (a GPU container has it; on CPU: pip install torch)"

pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
"$PYTHON" - >"$pins" <<'PY'
import re
from importlib import metadata

keep = re.compile(r"(torch|torchvision|torchaudio|triton|pytorch-triton|transformer[-_]engine.*|apex|flash[-_]attn.*|"
                  r"nvidia-.*)", re.I)
for dist in metadata.distributions():
    name = dist.metadata["Name"]
    if name and keep.fullmatch(name):
        print(f"{name}=={dist.version}")
PY
echo "docker/install.sh: keeping $(paste -sd' ' "$pins")"
export PIP_CONSTRAINT="$pins${PIP_CONSTRAINT:+ $PIP_CONSTRAINT}"
export DS_BUILD_OPS=${DS_BUILD_OPS:-0}  # deepspeed (extra "profile"): no CUDA ops built at install time

pip=("$PYTHON" -m pip install -q --disable-pip-version-check)
if ! "$PYTHON" -c "import sys; sys.exit(sys.version_info < (3, 12))"; then
    # megatron-core alone past its Requires-Python (--ignore-requires-python for the whole install would let pip
    # pick other packages' newest releases, which need 3.12, and build them from source); pip keeps an installed
    # distribution without checking its Requires-Python, so the package's own install below accepts it.
    "${pip[@]}" --no-deps --ignore-requires-python "megatron-core==${MCORE_VERSION:-0.19.2}"
fi
target="${MSAT_SOURCE:-$src}${extras:+[$extras]}"
if [ "${MSAT_EDITABLE:-0}" = 1 ]; then target=(-e "$target"); else target=("$target"); fi
"${pip[@]}" "megatron-core==${MCORE_VERSION:-0.19.2}" "${target[@]}"

after=$("$PYTHON" -c "import torch; print(torch.__version__, torch.__file__)")
[ "$before" = "$after" ] || die "torch changed from '$before' to '$after'"
"$PYTHON" -W ignore -c "import megatron.core, megatron_sat, torch; print('docker/install.sh: megatron-sat', \
megatron_sat.__version__, '| megatron-core', megatron.core.__version__, '| torch', torch.__version__, '(kept)')"
