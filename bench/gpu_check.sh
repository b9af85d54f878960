#!/usr/bin/env bash
# The prepared GPU check: run once where a CUDA machine is lent (e.g. through the device tool), from the repo root.
# 1. the CUDA-only tests: one training step with the hooks and the guard under torch.cuda.set_sync_debug_mode("error")
# 2. the capture overhead on the GPU (the ≤ 1 % budget), with a batch large enough for the GPU to be busy.
set -euo pipefail
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m pytest -q -p no:cacheprovider tests/test_hooks.py tests/test_guard.py -k cuda -rs
python bench/bench_overhead.py --device cuda --batch 64 --rounds 7 --steps 20
