#!/usr/bin/env bash
# The prepared GPU check: run once where a CUDA machine is lent (e.g. through the device tool), from the repo root.
# Under 5 minutes on one GPU; each step has its own time limit so one slow part cannot eat the rest.
# 1. the CUDA-only tests: training steps with the hooks (every signal on every step, clip_grad_norm_ sharing the
#    capture's norms, a loop without optimizer) and the guard under torch.cuda.set_sync_debug_mode("error"):
#    any host-device sync inside stability's code fails them (syncs counted = 0), and the step-time / memory
#    signals on CUDA (allocator counters, device step time from CUDA events read a step later);
# 2. the capture overhead on the GPU (the <= 1 % budget at defaults, <= 5 % with every signal), a batch large
#    enough for the GPU to be busy, on the 4-layer model and on the 24-layer one (293 parameter tensors);
# 3. the side-by-side comparison on CUDA, with the extra peak device memory of each mode.
set -euo pipefail
export OMP_NUM_THREADS=1 PYTHONPATH="${PYTHONPATH:-$PWD}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_hooks.py tests/test_guard.py tests/test_slowdowns.py -k cuda -rs
timeout 60 python bench/bench_overhead.py --device cuda --batch 64 --rounds 7 --steps 20
timeout 60 python bench/bench_overhead.py --device cuda --batch 16 --layers 24 --rounds 5 --steps 10
WANDB_MODE=offline timeout 60 python bench/bench_side_by_side.py --device cuda --batch 64 --rounds 5 --steps 10
