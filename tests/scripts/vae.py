"""A small re-creation of pytorch/examples ``vae/main.py``: the fully connected variational auto-encoder
(``fc1`` 784->400, ``fc21`` / ``fc22`` 400->20 for mu and log-variance, the reparameterisation trick, ``fc3``
20->400, ``fc4`` 400->784 and a sigmoid), trained with ``optim.Adam(lr=1e-3)`` on the loss
``BCE(recon, x, reduction='sum') + KLD`` summed over the batch (not averaged: about 100x the batch size at the
start, falling fast), the loop ``zero_grad(); recon, mu, logvar = model(data); loss = loss_function(...);
loss.backward(); train_loss += loss.item(); optimizer.step()``, the per-sample ``Train Epoch`` prints and a test
pass after each epoch.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The data are synthetic 28x28 "digits" in
[0, 1] (ten seeded smooth stroke-like prototypes, randomly shifted, a little noise, squashed by a sigmoid,
generated here) instead of MNIST, so nothing is downloaded.

    python tests/scripts/vae.py --steps 200 --fault none|lr|nan|batch

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100
from then on, ``nan`` puts a NaN in one pixel of that batch (``binary_cross_entropy`` refuses a NaN target: the
script dies of it, as ``dcgan.py`` does), ``batch`` replaces that batch's images by uniform noise.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn, optim

import stability.auto  # noqa: F401  (the only stability line)


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    """Reconstruction + KL divergence losses summed over all elements and batch."""
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction="sum")
    # see Appendix B from VAE paper: Kingma and Welling. Auto-Encoding Variational Bayes. ICLR, 2014
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def synthetic_digits(n, seed):
    """Ten smooth 28x28 prototypes (seed 0), each sample shifted by up to 3 pixels, plus a little noise; pixels
    in [0, 1], mostly near 0 with brighter strokes, like MNIST's."""
    proto_gen = torch.Generator().manual_seed(0)
    prototypes = F.avg_pool2d(torch.randn(10, 1, 34, 34, generator=proto_gen), 5, 1)  # 30x30, smooth
    prototypes = prototypes / prototypes.std()
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    dx = torch.randint(0, 3, (n,), generator=gen)
    dy = torch.randint(0, 3, (n,), generator=gen)
    shifts = zip(y.tolist(), dx.tolist(), dy.tolist(), strict=True)
    x = torch.stack([prototypes[c, :, i:i + 28, j:j + 28] for c, i, j in shifts])
    x = x + 0.3 * torch.randn(x.shape, generator=gen)
    return torch.sigmoid(4 * (x - 1)), y


def batches(x, batch_size, gen):
    order = torch.randperm(len(x), generator=gen)
    for i in range(0, len(x) - batch_size + 1, batch_size):
        yield x[order[i:i + batch_size]]


def train(args, model, data, optimizer, epoch, state):
    model.train()
    train_loss = 0
    seen = 0
    for batch_idx, data_b in enumerate(data):
        if state["step"] >= args.steps:
            break
        if args.fault == "lr" and state["step"] == args.fault_step:
            for group in optimizer.param_groups:
                group["lr"] *= 100
        if args.fault == "nan" and state["step"] == args.fault_step:
            data_b = data_b.clone()
            data_b[0, 0, 14, 14] = float("nan")
        if args.fault == "batch" and state["step"] == args.fault_step:
            data_b = torch.rand_like(data_b)
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data_b)
        loss = loss_function(recon_batch, data_b, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        seen += len(data_b)
        optimizer.step()
        state["step"] += 1
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data_b)}]\tLoss: {loss.item() / len(data_b):.6f}",
                  flush=True)
    print(f"====> Epoch: {epoch} Average loss: {train_loss / max(seen, 1):.4f}", flush=True)


def test(model, x_test, batch_size):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for i in range(0, len(x_test), batch_size):
            data_b = x_test[i:i + batch_size]
            recon_batch, mu, logvar = model(data_b)
            test_loss += loss_function(recon_batch, data_b, mu, logvar).item()
    print(f"====> Test set loss: {test_loss / len(x_test):.4f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description="VAE MNIST Example (small, synthetic digits)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--train-size", type=int, default=2560)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    x_train, _ = synthetic_digits(args.train_size, seed=1)
    x_test, _ = synthetic_digits(256, seed=2)
    model = VAE()
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    state = {"step": 0}
    epoch = 1
    while state["step"] < args.steps:
        train(args, model, batches(x_train, args.batch_size, gen), optimizer, epoch, state)
        test(model, x_test, args.batch_size)
        epoch += 1


if __name__ == "__main__":
    main()
