"""A small re-creation of the PyTorch tutorial "What is torch.nn really?" (pytorch/tutorials,
``beginner_source/nn_tutorial.py``), at the stage where the model is an ``nn.Module`` but the update is still
written by hand: ``p -= p.grad * lr`` under ``torch.no_grad()`` followed by ``model.zero_grad()``, no optimizer,
no clipping, one backward per step, the loss printed per epoch on a validation set.

Re-created from the public tutorial for stability's tests, not copied. pytorch/tutorials is distributed under the
BSD 3-Clause licence, Copyright (c) 2017-2022, the PyTorch contributors. The data are synthetic 28x28 "digits"
(ten seeded prototypes plus noise, generated here) instead of MNIST, so nothing is downloaded.

    python tests/scripts/nn_tutorial.py --steps 300 --fault none|lr|nan|batch

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100
from then on, ``nan`` puts a NaN in one pixel of that batch, ``batch`` gives that batch random labels and images.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import stability.auto  # noqa: F401  (the only stability line)


def synthetic_digits(n, seed):
    prototypes = torch.randn(10, 784, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    x = prototypes[y] * 0.06 + torch.randn(n, 784, generator=gen)
    return x, y


class Mnist_MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(784, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, xb):
        return self.out(F.relu(self.hidden(xb)))


def accuracy(out, yb):
    preds = torch.argmax(out, dim=1)
    return (preds == yb).float().mean()


def main():
    parser = argparse.ArgumentParser(description="the nn tutorial's hand-written training loop, small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    fault_step = args.fault_step if args.fault_step is not None else int(args.steps * 0.6)

    torch.manual_seed(0)
    x_train, y_train = synthetic_digits(3200, seed=1)
    x_valid, y_valid = synthetic_digits(640, seed=2)
    n = x_train.shape[0]
    bs = 64  # batch size
    lr = 0.03  # learning rate
    model = Mnist_MLP()
    loss_func = F.cross_entropy

    step = 0
    epoch = 0
    while step < args.steps:
        model.train()
        for i in range((n - 1) // bs + 1):
            if step >= args.steps:
                break
            start_i = i * bs
            end_i = start_i + bs
            xb = x_train[start_i:end_i]
            yb = y_train[start_i:end_i]
            if args.fault == "lr" and step == fault_step:
                lr *= 100
            if args.fault == "nan" and step == fault_step:
                xb = xb.clone()
                xb[0, 100] = float("nan")
            if args.fault == "batch" and step == fault_step:
                xb = torch.randn_like(xb) * 5
                yb = torch.randint_like(yb, 10)
            pred = model(xb)
            loss = loss_func(pred, yb)

            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= p.grad * lr
                model.zero_grad()
            step += 1
        model.eval()
        with torch.no_grad():
            valid_out = model(x_valid)
            valid_loss = loss_func(valid_out, y_valid)
        print(epoch, f"valid loss {float(valid_loss):.4f} acc {float(accuracy(valid_out, y_valid)):.3f}", flush=True)
        epoch += 1


if __name__ == "__main__":
    main()
