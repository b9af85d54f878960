"""A small re-creation of pytorch/examples ``super_resolution`` (``main.py`` and ``model.py``): the sub-pixel CNN of
Shi et al. 2016 (``conv1`` 1->64 5x5, ``conv2`` 64->64 3x3, ``conv3`` 64->32 3x3, ReLU after each, ``conv4``
32->upscale**2 3x3, ``nn.PixelShuffle(upscale)``; orthogonal initialisation, with the ReLU gain for the first three),
trained on the luminance of low-resolution crops (bicubic-downscaled by the upscale factor, 3) to predict the
high-resolution crops: ``nn.MSELoss()``, ``optim.Adam(lr=0.01)``, the loop ``optimizer.zero_grad(); loss =
criterion(model(input), target); epoch_loss += loss.item(); loss.backward(); optimizer.step()``, the ``===>
Epoch[e](i/n): Loss`` prints and the test PSNR after each epoch.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The images are synthetic 48x48 luminance crops
in [0, 1] (seeded smooth random fields plus a few sharp-edged rectangles, generated here) instead of BSDS300, so
nothing is downloaded.

    python tests/scripts/super_resolution.py --steps 200 --fault none|lr|nan|batch

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100
from then on, ``nan`` puts a NaN in one pixel of one low-resolution input of that batch, ``batch`` replaces that
batch's high-resolution targets by uniform noise.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.nn import init

import stability.auto  # noqa: F401  (the only stability line)


class Net(nn.Module):
    def __init__(self, upscale_factor):
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(1, 64, (5, 5), (1, 1), (2, 2))
        self.conv2 = nn.Conv2d(64, 64, (3, 3), (1, 1), (1, 1))
        self.conv3 = nn.Conv2d(64, 32, (3, 3), (1, 1), (1, 1))
        self.conv4 = nn.Conv2d(32, upscale_factor ** 2, (3, 3), (1, 1), (1, 1))
        self.pixel_shuffle = nn.PixelShuffle(upscale_factor)
        self._initialize_weights()

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        return self.pixel_shuffle(self.conv4(x))

    def _initialize_weights(self):
        init.orthogonal_(self.conv1.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv2.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv3.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv4.weight)


def synthetic_crops(n, size, upscale, seed):
    """High-resolution ``size`` x ``size`` crops in [0, 1]: a smooth random field (noise blurred twice) plus two
    sharp-edged rectangles of random brightness each; the inputs are their bicubic (anti-aliased) downscaling."""
    gen = torch.Generator().manual_seed(seed)
    field = torch.randn(n, 1, size + 8, size + 8, generator=gen)
    field = F.avg_pool2d(F.avg_pool2d(field, 5, 1), 5, 1)
    field = 0.5 + 0.25 * field / field.std()
    ys, xs = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for _ in range(2):
        x0, y0 = torch.randint(0, size - 8, (2, n, 1, 1, 1), generator=gen)
        w, h = torch.randint(6, size // 2, (2, n, 1, 1, 1), generator=gen)
        inside = (xs >= x0) & (xs < x0 + w) & (ys >= y0) & (ys < y0 + h)
        level = torch.rand(n, 1, 1, 1, generator=gen) - 0.5
        field = field + 0.5 * inside * level
    target = field.clamp(0, 1)
    inputs = F.interpolate(target, scale_factor=1 / upscale, mode="bicubic", antialias=True).clamp(0, 1)
    return inputs, target


def batches(inputs, targets, batch_size, gen):
    order = torch.randperm(len(inputs), generator=gen)
    for i in range(0, len(inputs) - batch_size + 1, batch_size):
        idx = order[i:i + batch_size]
        yield inputs[idx], targets[idx]


def train(args, model, criterion, optimizer, data, epoch, n_batches, state):
    epoch_loss = 0
    for iteration, (input_b, target) in enumerate(data, 1):
        if state["step"] >= args.steps:
            break
        if args.fault == "lr" and state["step"] == args.fault_step:
            for group in optimizer.param_groups:
                group["lr"] *= 100
        if args.fault == "nan" and state["step"] == args.fault_step:
            input_b = input_b.clone()
            input_b[0, 0, 8, 8] = float("nan")
        if args.fault == "batch" and state["step"] == args.fault_step:
            target = torch.rand_like(target)
        optimizer.zero_grad()
        loss = criterion(model(input_b), target)
        epoch_loss += loss.item()
        loss.backward()
        optimizer.step()
        state["step"] += 1
        if iteration % args.log_interval == 0:
            print(f"===> Epoch[{epoch}]({iteration}/{n_batches}): Loss: {loss.item():.4f}", flush=True)
    print(f"===> Epoch {epoch} Complete: Avg. Loss: {epoch_loss / n_batches:.4f}", flush=True)


def test(model, criterion, inputs, targets):
    avg_psnr = 0
    with torch.no_grad():
        for i in range(len(inputs)):
            mse = criterion(model(inputs[i:i + 1]), targets[i:i + 1])
            avg_psnr += 10 * math.log10(1 / mse.item())
    print(f"===> Avg. PSNR: {avg_psnr / len(inputs):.4f} dB", flush=True)


def main():
    parser = argparse.ArgumentParser(description="PyTorch Super Res Example (small, synthetic crops)")
    parser.add_argument("--upscale-factor", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--crop-size", type=int, default=48)
    parser.add_argument("--train-size", type=int, default=400)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    x_train, y_train = synthetic_crops(args.train_size, args.crop_size, args.upscale_factor, seed=1)
    x_test, y_test = synthetic_crops(16, args.crop_size, args.upscale_factor, seed=2)
    model = Net(upscale_factor=args.upscale_factor)
    criterion = nn.MSELoss()
    optimizer = optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    n_batches = args.train_size // args.batch_size
    state = {"step": 0}
    epoch = 1
    while state["step"] < args.steps:
        train(args, model, criterion, optimizer, batches(x_train, y_train, args.batch_size, gen), epoch, n_batches,
              state)
        test(model, criterion, x_test, y_test)
        epoch += 1


if __name__ == "__main__":
    main()
