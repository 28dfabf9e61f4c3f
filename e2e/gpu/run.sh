#!/usr/bin/env bash
# The node agent against a real NVIDIA GPU: an NVML snapshot, then a process that allocates a
# known number of bytes (CUDA driver API through ctypes, no CUDA toolkit or framework needed)
# must show up in the snapshot's used memory and processes. Prints the readings as JSON.
#
#   e2e/gpu/run.sh [BYTES]        (default 8 GiB; needs the NVIDIA driver: libnvidia-ml, libcuda)
#
# Not part of CI: run it on a GPU machine. It installs nothing beyond the project's own Python
# dependencies from PyPI, into .venv unless $PYTHON names an interpreter that already has them.
set -euo pipefail
cd "$(dirname "$0")/../.."

BYTES="${1:-8589934592}"
OUT="${OUT:-$(mktemp -d -t vramguard-gpu.XXXXXX)}"
mkdir -p "$OUT"
echo "readings go to $OUT" >&2

if [[ -z "${PYTHON:-}" ]]; then
    if [[ ! -x .venv/bin/python ]]; then
        python3 -m venv .venv
        .venv/bin/python -m pip install --quiet -e .
    fi
    PYTHON=.venv/bin/python
fi

nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,mig.mode.current --format=csv \
    > "$OUT/nvidia-smi.csv" 2>&1 || echo "nvidia-smi not available" > "$OUT/nvidia-smi.csv"

# One agent reading as the DaemonSet would take it (no kubelet socket here: placements unknown).
"$PYTHON" -m vramguard agent --once --host-pid --podresources-socket "$OUT/no-kubelet.sock" > "$OUT/agent-once.json"

# Snapshot, allocate, snapshot again, compare.
"$PYTHON" e2e/gpu/allocate_and_read.py --bytes "$BYTES" | tee "$OUT/readings.json"
