"""A small re-creation of pytorch/examples ``dcgan/main.py``: a transposed-convolution generator and a convolutional
discriminator with BatchNorm, ``nn.BCELoss``, two ``optim.Adam(lr=2e-4, betas=(0.5, 0.999))``, and the loop of the
example: the discriminator steps first (``errD_real.backward()``, ``errD_fake.backward()`` on ``fake.detach()``,
``optimizerD.step()``), then the generator (``errG.backward()`` through the discriminator, whose gradients it leaves
for the next ``netD.zero_grad()``, ``optimizerG.step()``), and the ``Loss_D / Loss_G / D(x) / D(G(z))`` print.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. Images are 16x16 synthetic "blobs" (a few
Gaussian bumps at random places, generated here) instead of LSUN / CIFAR, so nothing is downloaded. Two optimizers,
two losses that fight each other by design: a clean run's losses swing without being unstable.

    python tests/scripts/dcgan.py --steps 200 --fault none|lr|nan|batch [--loss-log losses.txt]

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies both learning rates by 100
from then on, ``nan`` puts a NaN in one pixel of that real batch, ``batch`` replaces that real batch by noise x 5.
``--loss-log`` writes, per iteration, ``errD`` (the discriminator's loss, as the example prints it).
"""

import argparse

import torch
from torch import nn, optim

import stability.auto  # noqa: F401  (the only stability line)


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),  # 8x8
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),  # 16x16
            nn.Tanh(),
        )

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self, nc, ndf):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),  # 8x8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),  # 1x1
            nn.Sigmoid(),
        )

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


def weights_init(m):
    name = m.__class__.__name__
    if "Conv" in name:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif "BatchNorm" in name:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def blobs(n, seed, size=16):
    """``n`` images of 1-3 Gaussian bumps at random places, scaled to [-1, 1] (the generator's Tanh range)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.stack(torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")).float()
    images = torch.zeros(n, 1, size, size)
    for k in range(3):
        centre = torch.rand(n, 2, 1, 1, generator=gen) * (size - 4) + 2
        width = 1.5 + 2.0 * torch.rand(n, 1, 1, 1, generator=gen)
        present = (torch.rand(n, 1, 1, 1, generator=gen) < (1.0 if k == 0 else 0.5)).float()
        dist = ((grid.unsqueeze(0) - centre) ** 2).sum(1, keepdim=True)
        images += present * torch.exp(-dist / (2 * width**2))
    return images.clamp(max=1.0) * 2 - 1


def main():
    parser = argparse.ArgumentParser(description="PyTorch DCGAN Example (small, synthetic blobs)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--nz", type=int, default=16)
    parser.add_argument("--ngf", type=int, default=16)
    parser.add_argument("--ndf", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.0002)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--train-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    parser.add_argument("--loss-log", default=None)
    opt = parser.parse_args()
    fault_step = opt.fault_step if opt.fault_step is not None else int(opt.steps * 0.6)

    torch.manual_seed(opt.seed)
    data = blobs(opt.train_size, seed=opt.seed)
    netG = Generator(opt.nz, opt.ngf, 1)
    netG.apply(weights_init)
    netD = Discriminator(1, opt.ndf)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    loss_log = open(opt.loss_log, "w") if opt.loss_log else None
    step, epoch = 0, 0
    while step < opt.steps:
        order = torch.randperm(len(data))
        batches = len(data) // opt.batch_size
        for i in range(batches):
            if step >= opt.steps:
                break
            real = data[order[i * opt.batch_size:(i + 1) * opt.batch_size]]
            if opt.fault == "lr" and step == fault_step:
                for group in [*optimizerD.param_groups, *optimizerG.param_groups]:
                    group["lr"] *= 100
            if opt.fault == "nan" and step == fault_step:
                real = real.clone()
                real[0, 0, 8, 8] = float("nan")
            if opt.fault == "batch" and step == fault_step:
                real = torch.randn_like(real) * 5

            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label)
            output = netD(real)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()

            noise = torch.randn(batch_size, opt.nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()

            if i % 10 == 0:
                print(f"[{epoch}][{i}/{batches}] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} "
                      f"D(x): {D_x:.4f} D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}", flush=True)
            if loss_log is not None:
                loss_log.write(f"{step} {errD.item()!r}\n")
            step += 1
        epoch += 1
    if loss_log is not None:
        loss_log.close()


if __name__ == "__main__":
    main()
