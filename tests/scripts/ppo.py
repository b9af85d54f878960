"""A small re-creation of vwxyzjn/cleanrl ``cleanrl/ppo.py`` (PPO, Schulman et al. 2017, discrete actions): an
actor-critic ``Agent`` (two ``Tanh`` MLPs, orthogonal init with gains sqrt(2), 0.01 for the actor's last layer, 1 for
the critic's), ``Adam(lr=2.5e-4, eps=1e-5)`` with the LR annealed linearly per iteration by writing
``optimizer.param_groups[0]["lr"]``, a rollout of ``num_steps`` (128) on ``num_envs`` (4) vectorised cart-poles under
``torch.no_grad()``, GAE (gamma 0.99, lambda 0.95), then ``update_epochs`` (4) epochs over ``num_minibatches`` (4)
shuffled minibatches: advantages normalised per minibatch, the clipped surrogate (``clip_coef`` 0.2), a clipped value
loss, an entropy bonus (``ent_coef`` 0.01), ``loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef``,
``optimizer.zero_grad(); loss.backward(); nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm=0.5);
optimizer.step()``: 16 optimizer steps on one rollout, then a new rollout with the updated policy.

Re-created from the public implementation for stability's tests, not copied. CleanRL is distributed under the MIT
licence, Copyright (c) 2019 CleanRL developers. The cart-pole is ``reinforce.py``'s (the classic equations, auto-reset
as gym's vector envs do), so neither gym nor a download is needed.

    python tests/scripts/ppo.py --steps 240 --fault none|lr|nan|batch

``--steps`` counts optimizer steps (minibatch updates; 16 a rollout). The fault is injected at ``--fault-step``
(default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100 from then on (the annealing's base LR too),
``nan`` puts a NaN in one advantage of that minibatch (as an environment's NaN reward would), ``batch`` replaces that
minibatch's observations by noise x5.
"""

import argparse

import numpy as np
import torch
from reinforce import CartPole  # tests/scripts/reinforce.py: its cart-pole
from torch import nn, optim
from torch.distributions.categorical import Categorical

import stability.auto  # noqa: F401  (the only stability line)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):  # noqa: B008  (as in the original)
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim=4, n_actions=2):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class VecCartPole:
    """``num_envs`` cart-poles stepped together; a finished episode resets at once (gym's autoreset)."""

    def __init__(self, num_envs, seed):
        self.envs = [CartPole(seed + i) for i in range(num_envs)]

    def reset(self):
        return np.stack([env.reset() for env in self.envs])

    def step(self, actions):
        obs, rewards, dones = [], [], []
        for env, action in zip(self.envs, actions, strict=True):
            o, r, d = env.step(int(action))
            obs.append(env.reset() if d else o)
            rewards.append(r)
            dones.append(d)
        return np.stack(obs), np.array(rewards), np.array(dones, dtype=np.float32)


def main():  # noqa: C901  (one long function, as in the original)
    parser = argparse.ArgumentParser(description="PPO on a cart-pole (CleanRL ppo.py, small)")
    parser.add_argument("--learning-rate", type=float, default=2.5e-4)
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=128)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--gae-lambda", type=float, default=0.95)
    parser.add_argument("--num-minibatches", type=int, default=4)
    parser.add_argument("--update-epochs", type=int, default=4)
    parser.add_argument("--clip-coef", type=float, default=0.2)
    parser.add_argument("--ent-coef", type=float, default=0.01)
    parser.add_argument("--vf-coef", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    updates_per_iteration = args.update_epochs * args.num_minibatches
    num_iterations = -(-args.steps // updates_per_iteration)

    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    envs = VecCartPole(args.num_envs, args.seed)
    agent = Agent()
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    obs = torch.zeros((args.num_steps, args.num_envs, 4))
    actions = torch.zeros((args.num_steps, args.num_envs))
    logprobs = torch.zeros((args.num_steps, args.num_envs))
    rewards = torch.zeros((args.num_steps, args.num_envs))
    dones = torch.zeros((args.num_steps, args.num_envs))
    values = torch.zeros((args.num_steps, args.num_envs))

    next_obs = torch.tensor(envs.reset(), dtype=torch.float32)
    next_done = torch.zeros(args.num_envs)
    updates = 0
    episode_return = np.zeros(args.num_envs)
    finished = []
    for iteration in range(1, num_iterations + 1):
        frac = 1.0 - (iteration - 1.0) / num_iterations
        optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        for step in range(args.num_steps):
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            o, r, d = envs.step(action.numpy())
            episode_return += r
            for i in np.nonzero(d)[0]:
                finished.append(episode_return[i])
                episode_return[i] = 0
            rewards[step] = torch.tensor(r, dtype=torch.float32)
            next_obs, next_done = torch.tensor(o, dtype=torch.float32), torch.tensor(d)

        with torch.no_grad():  # bootstrap value if not done
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1, 4))
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        b_inds = np.arange(batch_size)
        clipfracs = []
        for _epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                if updates >= args.steps:
                    break
                mb_inds = b_inds[start:start + minibatch_size]
                mb_obs = b_obs[mb_inds]
                mb_advantages = b_advantages[mb_inds]
                if args.fault == "lr" and updates == args.fault_step:
                    args.learning_rate *= 100
                    optimizer.param_groups[0]["lr"] *= 100
                if args.fault == "nan" and updates == args.fault_step:
                    mb_advantages = mb_advantages.clone()
                    mb_advantages[0] = float("nan")
                if args.fault == "batch" and updates == args.fault_step:
                    mb_obs = torch.randn_like(mb_obs) * 5

                _, newlogprob, entropy, newvalue = agent.get_action_and_value(mb_obs, b_actions.long()[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()

                with torch.no_grad():
                    clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]

                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                # Policy loss
                pg_loss1 = -mb_advantages * ratio
                pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                # Value loss
                newvalue = newvalue.view(-1)
                v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                v_clipped = b_values[mb_inds] + torch.clamp(
                    newvalue - b_values[mb_inds],
                    -args.clip_coef,
                    args.clip_coef,
                )
                v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
                v_loss = 0.5 * v_loss_max.mean()

                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                updates += 1

        recent = finished[-20:]
        print(f"iteration {iteration} updates {updates} episodic_return {np.mean(recent) if recent else 0:.1f} "
              f"value_loss {v_loss.item():.3f} policy_loss {pg_loss.item():.4f} clipfrac {np.mean(clipfracs):.3f}",
              flush=True)


if __name__ == "__main__":
    main()
