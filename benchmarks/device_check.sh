#!/usr/bin/env bash
# Every GPU check of affdiv.layers in one call, on any CUDA machine, run from the repository root:
# the CUDA layer tests, the Triton kernel tests, then benchmarks/gpu_check.py (correctness against
# float64 and the timings against cuBLAS and torch.compile). Logs and JSON go to the folder given
# as the first argument (default ./device-out):  bash benchmarks/device_check.sh [FOLDER]
# The machine's own python3 holds CUDA torch and Triton; affdiv is imported from this checkout
# (the import name affdiv is the repository root, so a link to it goes on PYTHONPATH).
# About 5 minutes on an H200 (allow 9). Without CUDA every part says why it skips.
set -o pipefail
out=${1:-device-out}
mkdir -p "$out"
root=$(mktemp -d)
ln -s "$PWD" "$root/affdiv"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
python3 -c "import torch, affdiv; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1 | tee "$out/environment.txt" || status=1
python3 -m pytest -q -rs -p no:cacheprovider tests/layers/test_cuda.py tests/layers/test_triton_affine_like.py 2>&1 \
    | tee "$out/cuda_tests.log" || status=1
python3 benchmarks/gpu_check.py --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log" || status=1
exit $status
