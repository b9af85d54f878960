"""A small re-creation of pytorch/examples ``siamese_network/main.py``: one shared tower embeds each image of a pair
(the example's ResNet-18 with a one-channel first convolution; here two convolutions with batch norm, as in a
ResNet, and a linear layer, so that it runs on a CPU in seconds), the two embeddings are concatenated and a head
``Linear -> ReLU -> Linear`` with a ``Sigmoid`` gives the probability that both images show the same digit;
``nn.BCELoss`` on that probability, ``optim.Adadelta(lr=1.0)`` and ``StepLR(step_size=1, gamma=0.7)`` stepped once
per epoch, the head's linear layers initialised ``xavier_uniform_`` with bias 0.01, and the loop ``zero_grad();
outputs = model(images_1, images_2).squeeze(); loss = criterion(outputs, targets); loss.backward();
optimizer.step()``. As in the example's ``APP_MATCHER`` dataset, each pair is a positive (same class, target 1) or a
negative (another class, target 0) with probability 1/2.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The images are the synthetic 28x28 digits of
``mnist.py`` (seeded, generated here, with less pixel noise: 1.0) instead of MNIST, so nothing is downloaded.

    python tests/scripts/siamese.py --steps 200 --fault none|lr|nan|batch

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100
from then on, ``nan`` puts a NaN in one pixel of one image of that batch (``BCELoss`` refuses the NaN probability:
the script dies of it, as ``dcgan.py`` does), ``batch`` replaces that batch's first images by noise x5 and flips its
targets.
"""

import argparse

import torch
import torch.nn.functional as F
from mnist import synthetic_digits  # tests/scripts/mnist.py: its data generator
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR

import stability.auto  # noqa: F401  (the only stability line)


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 5, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.embed = nn.Linear(32 * 4 * 4, 64)
        self.fc = nn.Sequential(nn.Linear(64 * 2, 128), nn.ReLU(inplace=True), nn.Linear(128, 1))
        self.sigmoid = nn.Sigmoid()
        self.fc.apply(self.init_weights)

    def init_weights(self, m):
        if isinstance(m, nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            m.bias.data.fill_(0.01)

    def forward_once(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return F.relu(self.embed(torch.flatten(x, 1)))

    def forward(self, input1, input2):
        output1 = self.forward_once(input1)
        output2 = self.forward_once(input2)
        output = torch.cat((output1, output2), 1)
        output = self.fc(output)
        return self.sigmoid(output)


def pairs(x, y, batch_size, gen):
    """The example's APP_MATCHER: each image paired with another of its class (target 1) or of another class
    (target 0), half and half."""
    by_class = [torch.nonzero(y == c).flatten() for c in range(10)]
    order = torch.randperm(len(y), generator=gen)
    for i in range(0, len(y) - batch_size + 1, batch_size):
        idx = order[i:i + batch_size]
        same = torch.rand(batch_size, generator=gen) < 0.5
        other = []
        for j, s in zip(idx.tolist(), same.tolist(), strict=True):
            c = int(y[j]) if s else (int(y[j]) + int(torch.randint(1, 10, (1,), generator=gen))) % 10
            pool = by_class[c]
            other.append(int(pool[torch.randint(0, len(pool), (1,), generator=gen)]))
        yield x[idx], x[torch.tensor(other)], same.float()


def train(args, model, data, optimizer, epoch, state):
    model.train()
    criterion = nn.BCELoss()
    for batch_idx, (images_1, images_2, targets) in enumerate(data):
        if state["step"] >= args.steps:
            return
        if args.fault == "lr" and state["step"] == args.fault_step:
            for group in optimizer.param_groups:
                group["lr"] *= 100
        if args.fault == "nan" and state["step"] == args.fault_step:
            images_1 = images_1.clone()
            images_1[0, 0, 14, 14] = float("nan")
        if args.fault == "batch" and state["step"] == args.fault_step:
            images_1 = torch.randn_like(images_1) * 5
            targets = 1 - targets
        optimizer.zero_grad()
        outputs = model(images_1, images_2).squeeze()
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        state["step"] += 1
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(images_1)}]\tLoss: {loss.item():.6f}", flush=True)


def test(model, data):
    model.eval()
    test_loss, correct, n = 0.0, 0, 0
    criterion = nn.BCELoss(reduction="sum")
    with torch.no_grad():
        for images_1, images_2, targets in data:
            outputs = model(images_1, images_2).squeeze()
            test_loss += criterion(outputs, targets).item()
            correct += torch.where(outputs > 0.5, 1, 0).eq(targets.view_as(outputs)).sum().item()
            n += len(targets)
    print(f"Test set: Average loss: {test_loss / n:.4f}, Accuracy: {correct}/{n}", flush=True)


def main():
    parser = argparse.ArgumentParser(description="PyTorch Siamese network Example (small, synthetic digits)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--train-size", type=int, default=3200)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    x_train, y_train = synthetic_digits(args.train_size, seed=1, noise=1.0)
    x_test, y_test = synthetic_digits(256, seed=2, noise=1.0)
    model = SiameseNetwork()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    gen = torch.Generator().manual_seed(args.seed)
    test_gen = torch.Generator().manual_seed(2)
    state = {"step": 0}
    epoch = 1
    while state["step"] < args.steps:
        train(args, model, pairs(x_train, y_train, args.batch_size, gen), optimizer, epoch, state)
        test(model, pairs(x_test, y_test, args.batch_size, test_gen))
        scheduler.step()
        epoch += 1


if __name__ == "__main__":
    main()
