"""A small re-creation of pytorch/tutorials ``intermediate/ddp_tutorial`` ("Getting Started with Distributed Data
Parallel", ``demo_basic``): ``mp.spawn(demo_basic, args=(world_size,), nprocs=world_size, join=True)`` starts one
process per rank; each sets ``MASTER_ADDR`` / ``MASTER_PORT``, calls ``init_process_group("gloo", rank=rank,
world_size=world_size)`` and trains a ``ToyModel`` (``Linear(10, 10)``, ReLU, ``Linear(10, 5)``) wrapped in
``DistributedDataParallel`` with ``SGD(lr=0.001)`` and ``MSELoss``. ``torch.multiprocessing.spawn`` sets no
``LOCAL_RANK``: every spawned rank looks like local rank 0 to a launcher-based tool.

Re-created from the public tutorial for stability's tests, not copied. pytorch/tutorials is distributed under the
BSD 3-Clause licence, Copyright (c) 2017-2022, the PyTorch contributors. The tutorial trains one step on random
data; here each rank trains ``--steps`` steps on its own seeded stream of a fixed random linear target, with a
larger LR (0.05) so the loss falls.

    python tests/scripts/ddp_tutorial.py --steps 80 --fault none|nan --port PORT

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``) on rank 1: ``nan`` puts a NaN in one
input of its batch.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stability.auto  # noqa: F401  (the only stability line)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def demo_basic(rank, world_size, args):
    setup(rank, world_size, args.port)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    target_map = torch.randn(10, 5, generator=torch.Generator().manual_seed(7))
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(20, 10, generator=data)
        y = x @ target_map
        if rank == 1 and step == args.fault_step and args.fault == "nan":
            x = x.clone()
            x[0, 3] = float("nan")
        optimizer.zero_grad()
        loss = loss_fn(ddp_model(x), y)
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="DDP tutorial (demo_basic), small")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--port", type=int, default=29512)
    parser.add_argument("--fault", choices=["none", "nan"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)
    mp.spawn(demo_basic, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
