"""A small re-creation of pytorch/examples ``mnist/main.py``: the two-convolution network with dropout and
``log_softmax``, ``F.nll_loss``, ``optim.Adadelta(lr=1.0)`` and ``StepLR(step_size=1, gamma=0.7)`` stepped once per
epoch, the loop ``zero_grad(); output = model(data); loss = F.nll_loss(output, target); loss.backward();
optimizer.step()`` and the ``Train Epoch`` / ``Test set`` prints.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The data are synthetic 28x28 "digits" (ten
seeded smooth prototypes, randomly shifted, plus noise, generated here) instead of MNIST, so nothing is downloaded;
like MNIST they are learnt to a training loss near 1e-2 where a few hard samples lift a batch's loss several-fold:
the heavy-tailed regime a clean run must not alarm on.

    python tests/scripts/mnist.py --steps 200 --fault none|lr|nan|batch [--batch-size 32]

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100
from then on, ``nan`` puts a NaN in one pixel of that batch, ``batch`` gives that batch random labels and images.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR

import stability.auto  # noqa: F401  (the only stability line)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_digits(n, seed, noise=2.5):
    """Ten smooth 28x28 prototypes (seed 0), each sample shifted by up to 3 pixels, plus pixel noise."""
    proto_gen = torch.Generator().manual_seed(0)
    prototypes = F.avg_pool2d(torch.randn(10, 1, 34, 34, generator=proto_gen), 5, 1)  # 30x30, smooth
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    dx = torch.randint(0, 3, (n,), generator=gen)
    dy = torch.randint(0, 3, (n,), generator=gen)
    shifts = zip(y.tolist(), dx.tolist(), dy.tolist(), strict=True)
    x = torch.stack([prototypes[c, :, i:i + 28, j:j + 28] for c, i, j in shifts])
    x = (x - x.mean()) / x.std() + noise * torch.randn(x.shape, generator=gen)
    return x, y


def batches(x, y, batch_size, gen):
    order = torch.randperm(len(y), generator=gen)
    for i in range(0, len(y) - batch_size + 1, batch_size):
        idx = order[i:i + batch_size]
        yield x[idx], y[idx]


def train(args, model, data, optimizer, epoch, state):
    model.train()
    for batch_idx, (data_b, target) in enumerate(data):
        if state["step"] >= args.steps:
            return
        if args.fault == "lr" and state["step"] == args.fault_step:
            for group in optimizer.param_groups:
                group["lr"] *= 100
        if args.fault == "nan" and state["step"] == args.fault_step:
            data_b = data_b.clone()
            data_b[0, 0, 14, 14] = float("nan")
        if args.fault == "batch" and state["step"] == args.fault_step:
            data_b = torch.randn_like(data_b) * 5
            target = torch.randint_like(target, 10)
        optimizer.zero_grad()
        output = model(data_b)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        state["step"] += 1
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data_b)}]\tLoss: {loss.item():.6f}", flush=True)


def test(model, x, y):
    model.eval()
    with torch.no_grad():
        output = model(x)
        loss = F.nll_loss(output, y, reduction="sum").item() / len(y)
        correct = output.argmax(dim=1).eq(y).sum().item()
    print(f"Test set: Average loss: {loss:.4f}, Accuracy: {correct}/{len(y)}", flush=True)


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (small, synthetic digits)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--train-size", type=int, default=1600)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    x_train, y_train = synthetic_digits(args.train_size, seed=1)
    x_test, y_test = synthetic_digits(400, seed=2)
    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    gen = torch.Generator().manual_seed(args.seed)
    state = {"step": 0}
    epoch = 1
    while state["step"] < args.steps:
        train(args, model, batches(x_train, y_train, args.batch_size, gen), optimizer, epoch, state)
        test(model, x_test, y_test)
        scheduler.step()
        epoch += 1


if __name__ == "__main__":
    main()
