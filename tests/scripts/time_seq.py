"""A small re-creation of pytorch/examples ``time_sequence_prediction`` (``generate_sine_wave.py`` + ``train.py``):
two stacked ``LSTMCell``s learn sine waves in float64, trained with ``torch.optim.LBFGS(lr=0.8)`` whose
``step(closure)`` calls the closure (zero_grad, forward, MSE loss, backward) up to 20 times per step; after each
step a no-grad forward predicts the future. The closure prints its loss on every call, as the example does.

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The waves are shorter (``--length``) and
fewer (``--waves``) than the example's 100 x 1000 so that a step takes well under a second on one CPU core.

    python tests/scripts/time_seq.py --steps 30 --fault none|lr|nan [--loss-log losses.txt]

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by
100 from then on, ``nan`` puts a NaN in one input value of that step. ``--loss-log`` writes, per step, the loss
of the closure's first call (the loss at the step's starting point, which ``LBFGS.step`` returns).
"""

import argparse

import numpy as np
import torch
from torch import nn

import stability.auto  # noqa: F401  (the only stability line)


def sine_waves(waves, length, period=20, seed=2):
    rng = np.random.RandomState(seed)
    x = np.empty((waves, length), np.int64)
    x[:] = np.arange(length) + rng.randint(-4 * period, 4 * period, waves).reshape(waves, 1)
    return np.sin(x / 1.0 / period).astype("float64")


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):  # predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def main():
    parser = argparse.ArgumentParser(description="time sequence prediction with LBFGS, small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--waves", type=int, default=24)
    parser.add_argument("--length", type=int, default=60)
    parser.add_argument("--fault", choices=["none", "lr", "nan"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    parser.add_argument("--loss-log", default=None)
    opt = parser.parse_args()
    fault_step = opt.fault_step if opt.fault_step is not None else int(opt.steps * 0.6)

    np.random.seed(0)
    torch.manual_seed(0)
    data = sine_waves(opt.waves, opt.length)
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    seq = Sequence().double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)
    loss_log = open(opt.loss_log, "w") if opt.loss_log else None

    for i in range(opt.steps):
        print("STEP: ", i)
        x = input
        if opt.fault == "lr" and i == fault_step:
            for group in optimizer.param_groups:
                group["lr"] *= 100
        if opt.fault == "nan" and i == fault_step:
            x = input.clone()
            x[0, 5] = float("nan")
        calls = []

        def closure(x=x, calls=calls):
            optimizer.zero_grad()
            out = seq(x)
            loss = criterion(out, target)
            print("loss:", loss.item())
            calls.append(loss.item())
            loss.backward()
            return loss

        optimizer.step(closure)
        if loss_log is not None:
            loss_log.write(f"{i} {calls[0]!r} {len(calls)}\n")
        with torch.no_grad():  # begin to predict, no need to track gradient here
            future = 20
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], target[:3])
            print("test loss:", loss.item())
    if loss_log is not None:
        loss_log.close()


if __name__ == "__main__":
    main()
