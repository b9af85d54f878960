"""A small re-creation of pytorch/examples ``regression/main.py``: fit a random degree-4 polynomial with one
``nn.Linear`` on the features ``x, x^2, x^3, x^4``, a hand-written update (``param.add_(-0.1 * param.grad)`` under
``no_grad``, ``fc.zero_grad()`` before each backward), batches of 32 random points, smooth L1 loss, until the
loss falls under 1e-3 or ``--steps`` run out. The loss falls by four orders of magnitude.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors.

    python tests/scripts/regression.py --steps 700 --fault none|lr|nan|batch

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the step size by 100
from then on, ``nan`` puts a NaN in one feature of that batch, ``batch`` gives that batch targets x30.
"""

import argparse

import torch
import torch.nn.functional as F

import stability.auto  # noqa: F401  (the only stability line)

POLY_DEGREE = 4
W_target = torch.randn(POLY_DEGREE, 1, generator=torch.Generator().manual_seed(1)) * 5
b_target = torch.randn(1, generator=torch.Generator().manual_seed(2)) * 5


def make_features(x):
    """Builds features i.e. a matrix with columns [x, x^2, x^3, x^4]."""
    x = x.unsqueeze(1)
    return torch.cat([x**i for i in range(1, POLY_DEGREE + 1)], 1)


def f(x):
    """Approximated function."""
    return x.mm(W_target) + b_target.item()


def get_batch(gen, batch_size=32):
    """Builds a batch i.e. (x, f(x)) pair."""
    random = torch.randn(batch_size, generator=gen)
    x = make_features(random)
    y = f(x)
    return x, y


def main():
    parser = argparse.ArgumentParser(description="polynomial regression with a hand-written update, small")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    fault_step = args.fault_step if args.fault_step is not None else int(args.steps * 0.6)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    fc = torch.nn.Linear(W_target.size(0), 1)
    lr = 0.1
    for batch_idx in range(args.steps):
        batch_x, batch_y = get_batch(gen)
        if args.fault == "lr" and batch_idx == fault_step:
            lr *= 100
        if args.fault == "nan" and batch_idx == fault_step:
            batch_x = batch_x.clone()
            batch_x[0, 1] = float("nan")
        if args.fault == "batch" and batch_idx == fault_step:
            batch_y = batch_y * 30
        fc.zero_grad()
        output = F.smooth_l1_loss(fc(batch_x), batch_y)
        loss = output.item()
        output.backward()
        with torch.no_grad():
            for param in fc.parameters():
                param.add_(-lr * param.grad)
        if batch_idx % 50 == 0:
            print(f"step {batch_idx} loss {loss:.6f}", flush=True)
        if loss < 1e-3:
            break
    print(f"Loss: {loss:.6f} after {batch_idx + 1} batches")


if __name__ == "__main__":
    main()
