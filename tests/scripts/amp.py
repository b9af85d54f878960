"""A small re-creation of the pytorch/tutorials recipe "Automatic Mixed Precision" (``recipes/amp_recipe.py``),
its loop with gradient clipping of unscaled gradients: a stack of ``Linear`` + ``ReLU`` layers, ``MSELoss``,
``SGD`` (here with momentum 0.9 and lr 0.1, so that it learns within a few hundred steps), clipped at 0.1 as in
the recipe (every step here), the
forward under ``torch.autocast`` (here ``"cpu"`` with ``bfloat16``, as on a CPU), and a ``torch.amp.GradScaler``:
``scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(net.parameters(), max_norm);
scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)`` (zero_grad last, as in the recipe).

Re-created from the public recipe for stability's tests, not copied. pytorch/tutorials is distributed under the
BSD 3-Clause licence, Copyright (c) 2017-2022, the PyTorch contributors. The recipe regresses random targets; the
targets here come from a fixed random teacher network plus noise (seeded, generated here), so the loss has
something to learn and falls.

    python tests/scripts/amp.py --steps 300 --fault none|lr|nan|batch

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100
from then on, ``nan`` puts a NaN in one input of that batch (the scaler finds the non-finite gradients, skips the
step and halves its scale), ``batch`` gives that batch targets x30.
"""

import argparse

import torch
from torch import nn

import stability.auto  # noqa: F401  (the only stability line)


def make_model(in_size, out_size, num_layers):
    layers = []
    for _ in range(num_layers - 1):
        layers.append(torch.nn.Linear(in_size, in_size))
        layers.append(torch.nn.ReLU())
    layers.append(torch.nn.Linear(in_size, out_size))
    return torch.nn.Sequential(*layers)


def teacher_data(n_batches, batch_size, in_size, out_size, seed):
    """Inputs ~ N(0, 1); targets from a fixed random two-layer teacher plus 10 % noise."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(in_size, in_size, generator=gen) / in_size**0.5
    w2 = torch.randn(in_size, out_size, generator=gen) / in_size**0.5
    data = [torch.randn(batch_size, in_size, generator=gen) for _ in range(n_batches)]
    targets = [torch.relu(x @ w1) @ w2 * 2 + 0.1 * torch.randn(batch_size, out_size, generator=gen) for x in data]
    return data, targets


def main():
    parser = argparse.ArgumentParser(description="Automatic Mixed Precision recipe (small, CPU bfloat16)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--in-size", type=int, default=256)
    parser.add_argument("--out-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--max-norm", type=float, default=0.1)
    parser.add_argument("--n-batches", type=int, default=50)
    parser.add_argument("--use-amp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    fault_step = args.fault_step if args.fault_step is not None else int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    device = "cpu"
    use_amp = bool(args.use_amp)
    net = make_model(args.in_size, args.out_size, args.num_layers)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()
    data, targets = teacher_data(args.n_batches, args.batch_size, args.in_size, args.out_size, seed=args.seed + 1)
    scaler = torch.amp.GradScaler(device, enabled=use_amp)

    step = 0
    epoch = 0
    while step < args.steps:
        for inputs, target in zip(data, targets, strict=True):
            if step >= args.steps:
                break
            if args.fault == "lr" and step == fault_step:
                for group in opt.param_groups:
                    group["lr"] *= 100
            if args.fault == "nan" and step == fault_step:
                inputs = inputs.clone()
                inputs[0, 0] = float("nan")
            if args.fault == "batch" and step == fault_step:
                target = target * 30
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=use_amp):
                output = net(inputs)
                loss = loss_fn(output, target)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=args.max_norm)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if step % 25 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.5f} grad norm {grad_norm.item():.5f} "
                      f"scale {scaler.get_scale():.0f}", flush=True)
            step += 1
        epoch += 1


if __name__ == "__main__":
    main()
