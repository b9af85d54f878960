"""A small re-creation of pytorch/examples ``mnist_forward_forward`` (Hinton's forward-forward algorithm): each
``Layer`` (an ``nn.Linear``) has its own Adam optimizer and is trained alone, for all its epochs, on a "goodness"
loss of positive and negative data, before the next layer starts on the first one's outputs. There is no model
``forward`` in training and no single optimizer: one training phase per layer.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The data are synthetic 8x8 "digits" (ten
seeded prototypes plus noise) instead of MNIST, and the layers are narrower, so nothing is downloaded.

    python tests/scripts/forward_forward.py --steps 150 --fault none|lr|nan

``--steps`` is the number of epochs per layer (two layers). The fault is injected in the second layer's phase,
``--fault-step`` epochs into it (default 60 % of ``--steps``): ``lr`` multiplies its learning rate by 100 from then
on, ``nan`` puts a NaN in one input value of that epoch.
"""

import argparse

import torch
from torch import nn

import stability.auto  # noqa: F401  (the only stability line)


def synthetic_digits(n, seed):
    prototypes = torch.rand(10, 64, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    x = prototypes[y] + 0.3 * torch.randn(n, 64, generator=gen)
    return x, y


def overlay_y_on_x(x, y):
    """Replace the first 10 pixels of data [x] with one-hot-encoded label [y]."""
    x_ = x.clone()
    x_[:, :10] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


class Layer(nn.Linear):
    def __init__(self, in_features, out_features, epochs, fault, fault_step):
        super().__init__(in_features, out_features)
        self.relu = torch.nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)
        self.threshold = 2.0
        self.num_epochs = epochs
        self.fault, self.fault_step = fault, fault_step

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train(self, x_pos, x_neg):
        for i in range(self.num_epochs):
            if self.fault == "lr" and i == self.fault_step:
                for group in self.opt.param_groups:
                    group["lr"] *= 100
            if self.fault == "nan" and i == self.fault_step:
                x_pos = x_pos.clone()
                x_pos[0, 3] = float("nan")
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            # The following loss pushes pos (neg) samples to values larger (smaller) than the self.threshold.
            loss = torch.log(1 + torch.exp(torch.cat([-g_pos + self.threshold, g_neg - self.threshold]))).mean()
            self.opt.zero_grad()
            # this backward just compute the derivative and hence is not considered backpropagation.
            loss.backward()
            self.opt.step()
            if i % 50 == 0:
                print(f"epoch {i} loss {loss.item():.4f}", flush=True)
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


class Net(torch.nn.Module):
    def __init__(self, dims, epochs, fault, fault_step):
        super().__init__()
        self.layers = []
        for d in range(len(dims) - 1):
            last = d == len(dims) - 2
            self.layers += [Layer(dims[d], dims[d + 1], epochs, fault if last else "none", fault_step)]

    def train(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for i, layer in enumerate(self.layers):
            print("training layer", i, "...", flush=True)
            h_pos, h_neg = layer.train(h_pos, h_neg)


def main():
    parser = argparse.ArgumentParser(description="forward-forward, one optimizer per layer, small")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--fault", choices=["none", "lr", "nan"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    fault_step = args.fault_step if args.fault_step is not None else int(args.steps * 0.6)

    torch.manual_seed(1234)
    x, y = synthetic_digits(1000, seed=1)
    net = Net([64, 128, 128], args.steps, args.fault, fault_step)
    x_pos = overlay_y_on_x(x, y)
    rnd = torch.randperm(x.size(0))
    x_neg = overlay_y_on_x(x, y[rnd])
    net.train(x_pos, x_neg)


if __name__ == "__main__":
    main()
