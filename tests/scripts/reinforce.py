"""A small re-creation of pytorch/examples ``reinforcement_learning/reinforce.py``: a policy network (Linear,
Dropout 0.6, ReLU, Linear, softmax) trained by REINFORCE with Adam(lr=1e-2) on a cart-pole, one optimizer step per
episode; the loss is ``sum(-log_prob * normalised return)``, a signed quantity whose sign and size swing from
episode to episode by design (no training signal a loss detector can read as "lower is better").

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The cart-pole is a few lines of the classic
equations (Barto, Sutton & Anderson 1983) here, so neither gym nor a download is needed.

    python tests/scripts/reinforce.py --steps 150 --fault none|lr|nan

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by
100 from then on, ``nan`` puts a NaN in one observation of that episode.
"""

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

import stability.auto  # noqa: F401  (the only stability line)


class CartPole:
    """The classic cart-pole: push left or right; +1 reward per step until the pole falls or the cart leaves."""

    def __init__(self, seed):
        self.rng = np.random.RandomState(seed)
        self.state = None

    def reset(self):
        self.state = self.rng.uniform(-0.05, 0.05, 4)
        return self.state.copy()

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        x, x_dot = x + 0.02 * x_dot, x_dot + 0.02 * x_acc
        theta, theta_dot = theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc
        self.state = np.array([x, x_dot, theta, theta_dot])
        done = abs(x) > 2.4 or abs(theta) > 12 * 2 * math.pi / 360
        return self.state.copy(), 1.0, done


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        return F.softmax(self.affine2(x), dim=1)


def main():
    parser = argparse.ArgumentParser(description="REINFORCE on a cart-pole, small")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    fault_step = args.fault_step if args.fault_step is not None else int(args.steps * 0.6)

    torch.manual_seed(543)
    env = CartPole(543)
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    eps = np.finfo(np.float32).eps.item()
    running_reward = 10.0
    for episode in range(args.steps):
        if args.fault == "lr" and episode == fault_step:
            for group in optimizer.param_groups:
                group["lr"] *= 100
        state, ep_reward = env.reset(), 0.0
        log_probs, rewards = [], []
        for t in range(args.max_len):
            obs = torch.from_numpy(state).float().unsqueeze(0)
            if args.fault == "nan" and episode == fault_step and t == 3:
                obs[0, 1] = float("nan")
            probs = policy(obs)
            m = Categorical(probs=torch.nan_to_num(probs, nan=0.5))  # the example would raise on NaN probs
            action = m.sample()
            log_probs.append(m.log_prob(action) + 0 * probs.sum())  # keeps a NaN in the graph, as the example would
            state, reward, done = env.step(action.item())
            rewards.append(reward)
            ep_reward += reward
            if done:
                break
        running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
        R, returns = 0.0, []
        for r in rewards[::-1]:
            R = r + args.gamma * R
            returns.insert(0, R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)
        policy_loss = torch.cat([-lp * R for lp, R in zip(log_probs, returns, strict=True)]).sum()
        optimizer.zero_grad()
        policy_loss.backward()
        optimizer.step()
        if episode % 10 == 0:
            print(f"Episode {episode}\tLast reward: {ep_reward:.2f}\tAverage reward: {running_reward:.2f}", flush=True)


if __name__ == "__main__":
    main()
