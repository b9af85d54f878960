"""A small re-creation of eriklindernoren/PyTorch-GAN ``implementations/wgan_gp/wgan_gp.py`` (WGAN with gradient
penalty, Gulrajani et al. 2017): an MLP generator (``Linear -> BatchNorm1d -> LeakyReLU(0.2)`` blocks, ``Tanh``) and
an MLP critic (``Linear -> LeakyReLU(0.2)``, no sigmoid), and the loop ``optimizer_D.zero_grad(); fake_imgs =
generator(z); real_validity = discriminator(real_imgs); fake_validity = discriminator(fake_imgs); gradient_penalty =
compute_gradient_penalty(discriminator, real_imgs.data, fake_imgs.data); d_loss = -torch.mean(real_validity) +
torch.mean(fake_validity) + lambda_gp * gradient_penalty; d_loss.backward(); optimizer_D.step();
optimizer_G.zero_grad()`` and, every ``n_critic = 5`` critic steps, ``g_loss = -torch.mean(discriminator(
generator(z))); g_loss.backward(); optimizer_G.step()`` (its gradient also lands in the critic's ``.grad``, cleared by
the next ``optimizer_D.zero_grad()``). The penalty is the example's: ``torch.autograd.grad(d_interpolates,
interpolates, grad_outputs=ones, create_graph=True, retain_graph=True, only_inputs=True)`` on random interpolates of
real and fake, ``((gradients.norm(2, dim=1) - 1) ** 2).mean()``: a double backward through the critic at every
critic step. Adam with the paper's ``lr=1e-4, betas=(0.0, 0.9)`` for both networks (the example: 2e-4, (0.5, 0.999)).
The critic loss is a signed Wasserstein estimate (negative, drifting) plus the penalty.

Re-created from the public implementation for stability's tests, not copied. PyTorch-GAN is distributed under the
MIT licence, Copyright (c) 2018 Erik Linder-Noren. The images are the synthetic 28x28 digits of ``mnist.py`` (seeded,
generated here, squashed to [-1, 1] by ``tanh``) instead of MNIST, so nothing is downloaded; the networks are
narrower so that it runs on a CPU in seconds.

    python tests/scripts/wgan_gp.py --steps 250 --fault none|lr|nan|batch

``--steps`` counts critic steps (``optimizer_D.step()``, the first optimizer to step: the tracked one); the generator
steps after every fifth. The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies
both learning rates by 100 from then on, ``nan`` puts a NaN in one pixel of that step's real batch, ``batch`` replaces
that step's real batch by noise x5.
"""

import argparse

import numpy as np
import torch
from mnist import synthetic_digits  # tests/scripts/mnist.py: its data generator
from torch import autograd, nn

import stability.auto  # noqa: F401  (the only stability line)

IMG = 28 * 28


class Generator(nn.Module):
    def __init__(self, latent_dim):
        super().__init__()

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 64, normalize=False),
            *block(64, 128),
            *block(128, 256),
            nn.Linear(256, IMG),
            nn.Tanh(),
        )

    def forward(self, z):
        return self.model(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(IMG, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 128),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(128, 1),
        )

    def forward(self, img):
        return self.model(img.view(img.shape[0], -1))


def compute_gradient_penalty(D, real_samples, fake_samples):
    """Calculates the gradient penalty loss for WGAN GP"""
    alpha = torch.rand(real_samples.size(0), 1)
    interpolates = (alpha * real_samples + ((1 - alpha) * fake_samples)).requires_grad_(True)
    d_interpolates = D(interpolates)
    fake = torch.ones(real_samples.shape[0], 1)
    gradients = autograd.grad(
        outputs=d_interpolates,
        inputs=interpolates,
        grad_outputs=fake,
        create_graph=True,
        retain_graph=True,
        only_inputs=True,
    )[0]
    gradients = gradients.view(gradients.size(0), -1)
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean()


def main():  # noqa: C901  (one long function, as in the original)
    parser = argparse.ArgumentParser(description="WGAN-GP (small, synthetic digits)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--b1", type=float, default=0.0)
    parser.add_argument("--b2", type=float, default=0.9)
    parser.add_argument("--latent-dim", type=int, default=32)
    parser.add_argument("--n-critic", type=int, default=5)
    parser.add_argument("--lambda-gp", type=float, default=10.0)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=25)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    parser.add_argument("--loss-log", default=None, help="write 'step d_loss' per critic step (for the tests)")
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    x, _ = synthetic_digits(args.train_size, seed=1, noise=0.3)
    x = torch.tanh(x).view(len(x), -1)
    generator = Generator(args.latent_dim)
    discriminator = Discriminator()
    optimizer_G = torch.optim.Adam(generator.parameters(), lr=args.lr, betas=(args.b1, args.b2))
    optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=args.lr, betas=(args.b1, args.b2))
    gen = torch.Generator().manual_seed(args.seed)
    log = open(args.loss_log, "w") if args.loss_log else None

    batches_done = 0
    epoch = 0
    while batches_done < args.steps:
        order = torch.randperm(len(x), generator=gen)
        for i in range(len(x) // args.batch_size):
            if batches_done >= args.steps:
                break
            real_imgs = x[order[i * args.batch_size:(i + 1) * args.batch_size]]
            if args.fault == "lr" and batches_done == args.fault_step:
                for optimizer in (optimizer_D, optimizer_G):
                    for group in optimizer.param_groups:
                        group["lr"] *= 100
            if args.fault == "nan" and batches_done == args.fault_step:
                real_imgs = real_imgs.clone()
                real_imgs[0, IMG // 2] = float("nan")
            if args.fault == "batch" and batches_done == args.fault_step:
                real_imgs = torch.randn_like(real_imgs) * 5

            # ---------------------
            #  Train Discriminator
            # ---------------------
            optimizer_D.zero_grad()
            z = torch.tensor(np.random.normal(0, 1, (real_imgs.shape[0], args.latent_dim)), dtype=torch.float32)
            fake_imgs = generator(z)
            real_validity = discriminator(real_imgs)
            fake_validity = discriminator(fake_imgs)
            gradient_penalty = compute_gradient_penalty(discriminator, real_imgs.data, fake_imgs.data)
            d_loss = -torch.mean(real_validity) + torch.mean(fake_validity) + args.lambda_gp * gradient_penalty
            d_loss.backward()
            optimizer_D.step()
            if log:
                log.write(f"{batches_done} {d_loss.item():.9g}\n")
            optimizer_G.zero_grad()

            # Train the generator every n_critic steps
            if i % args.n_critic == 0:
                fake_imgs = generator(z)
                fake_validity = discriminator(fake_imgs)
                g_loss = -torch.mean(fake_validity)
                g_loss.backward()
                optimizer_G.step()
                if batches_done % args.log_interval == 0:
                    print(f"[Epoch {epoch}] [Batch {i}] [D loss: {d_loss.item():f}] [G loss: {g_loss.item():f}]",
                          flush=True)
            batches_done += 1
        epoch += 1
    if log:
        log.close()


if __name__ == "__main__":
    main()
