"""A small re-creation of pytorch/examples ``mnist_hogwild``: one CNN in shared memory (``model.share_memory()``),
trained at once by ``--num-processes`` processes started with ``torch.multiprocessing`` (``fork``: each runs
``train(rank, args, model)`` with its own ``SGD(lr, momentum)`` and its own data order, updating the shared weights
without locks), then tested by the parent, which never trains itself.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The data are synthetic 28x28 "digits" (ten
seeded smooth prototypes, randomly shifted, plus noise: ``mnist.py``'s generator, with less noise) instead of
MNIST, so nothing is downloaded.

    python tests/scripts/mnist_hogwild.py --steps 120 --fault none|nan|batch [--num-processes 2]

``--steps`` is each process's number of steps. The fault is injected in process 1 only, at ``--fault-step``
(default 60 % of ``--steps``): ``nan`` puts a NaN in one pixel of that batch, ``batch`` gives that batch random
labels and images five times the data's scale.
"""

import argparse

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from mnist import synthetic_digits, test  # tests/scripts/mnist.py: its data generator and test pass
from torch import nn, optim

import stability.auto  # noqa: F401  (the only stability line)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def train(rank, args, model, x, y):
    torch.manual_seed(args.seed + rank)
    torch.set_num_threads(1)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model.train()
    step = 0
    while step < args.steps:
        order = torch.randperm(len(y))
        for i in range(0, len(y) - args.batch_size + 1, args.batch_size):
            if step >= args.steps:
                break
            data, target = x[order[i:i + args.batch_size]], y[order[i:i + args.batch_size]]
            if rank == 1 and step == args.fault_step and args.fault == "nan":
                data = data.clone()
                data[0, 0, 14, 14] = float("nan")
            if rank == 1 and step == args.fault_step and args.fault == "batch":
                data = torch.randn_like(data) * 5
                target = torch.randint_like(target, 10)
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if step % args.log_interval == 0:
                print(f"{rank}\tTrain step: {step}\tLoss: {loss.item():.6f}", flush=True)
            step += 1


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Hogwild Example (small, synthetic digits)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=1600)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--fault", choices=["none", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    parser.add_argument("--start-method", choices=["fork", "spawn", "forkserver"], default=None,
                        help="multiprocessing start method (W&B's hogwild examples and Python >= 3.14 don't fork)")
    args = parser.parse_args()
    if args.start_method:
        mp.set_start_method(args.start_method, force=True)
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    x_train, y_train = synthetic_digits(args.train_size, seed=1, noise=1.5)  # easier than mnist.py's 2.5
    x_test, y_test = synthetic_digits(400, seed=2, noise=1.5)
    model = Net()
    model.share_memory()  # gradients are allocated lazily, so they are not shared here
    processes = []
    for rank in range(args.num_processes):
        p = mp.Process(target=train, args=(rank, args, model, x_train, y_train))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    test(model, x_test, y_test)


if __name__ == "__main__":
    main()
