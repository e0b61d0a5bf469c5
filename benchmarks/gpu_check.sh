#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the vllm and hf backends on the same weights, tokens/s of each
# and their greedy parity before and after a weight sync (benchmarks/gpu_check.py prints JSON).
# Builds its own environment (.venv-gpu: vLLM's CUDA wheel brings the torch it needs), then runs
# the check and the CUDA paths of the suite. Usage: bash benchmarks/gpu_check.sh [gpu_check.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q vllm
  "$VENV/bin/pip" install -q -e '.[dev]'
fi
"$VENV/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"
"$VENV/bin/python" benchmarks/gpu_check.py "$@"
"$VENV/bin/pytest" -q -p no:cacheprovider tests/core/engine/test_cuda_paths.py
