"""A small re-creation of Andrej Karpathy's nanoGPT (``model.py`` and ``train.py``): a GPT with learned position
embeddings (``wpe``) and a weight-tied ``lm_head``, AdamW with weight-decay groups (2-D tensors decay, biases and
LayerNorm weights do not), a cosine learning rate with linear warm-up, gradient accumulation with the loss divided
by ``gradient_accumulation_steps`` before ``backward()``, a ``GradScaler`` that is disabled unless the dtype is
float16 (so disabled on the CPU), ``clip_grad_norm_`` after ``unscale_`` and ``zero_grad(set_to_none=True)``.

Re-created from the public repository for stability's tests, not copied. nanoGPT is distributed under the MIT
licence, Copyright (c) 2022 Andrej Karpathy. The data are a synthetic token stream (a seeded Markov chain,
generated here) instead of a tokenized corpus on disk, and the model is tiny so the script runs on a CPU.

    python tests/scripts/nanogpt.py --steps 150 --fault none|lr|nan|batch [--loss-log losses.txt]

The fault is injected at iteration ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning
rate by 100 from then on, ``nan`` poisons the token-embedding row of one input token, ``batch`` makes every
micro-batch of that iteration random tokens. ``--loss-log`` writes, per iteration, the mean of the undivided
micro-batch losses (a test reference; nanoGPT itself only prints the last micro-batch's loss).
"""

import argparse
import inspect
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

import stability.auto  # noqa: F401  (the only stability line)

# ------------------------------------------------------------------------------------------------ model.py


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # scaled init of the residual projections, per GPT-2
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        _b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        print(f"num decayed parameter tensors: {len(decay_params)}, with "
              f"{sum(p.numel() for p in decay_params):,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with "
              f"{sum(p.numel() for p in nodecay_params):,} parameters")
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)


# ------------------------------------------------------------------------------------------------ train.py


def parse_args():
    parser = argparse.ArgumentParser(description="tiny nanoGPT-style training")
    parser.add_argument("--steps", type=int, default=150, help="max_iters")
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    parser.add_argument("--loss-log", default=None)
    parser.add_argument("--seed", type=int, default=1337)
    return parser.parse_args()


def main():  # noqa: C901  (one long function, as in the original)
    args = parse_args()
    # config (a scaled-down shakespeare_char)
    eval_interval = 50
    eval_iters = 4
    log_interval = 20
    gradient_accumulation_steps = 4
    batch_size = 8
    block_size = 32
    n_layer, n_head, n_embd, dropout, bias = 2, 2, 32, 0.0, True
    learning_rate = 3e-3
    max_iters = args.steps
    weight_decay = 1e-1
    beta1, beta2 = 0.9, 0.99
    grad_clip = 1.0
    decay_lr = True
    warmup_iters = 20
    lr_decay_iters = max_iters
    min_lr = learning_rate / 10
    device = "cpu"
    dtype = "float32"
    fault_step = args.fault_step if args.fault_step is not None else int(max_iters * 0.6)

    torch.manual_seed(args.seed)
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    # data: a synthetic token stream (every token has 4 likely successors)
    vocab_size = 64
    chain = torch.Generator().manual_seed(7)
    successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=chain)

    def stream(n, seed):
        gen = torch.Generator().manual_seed(seed)
        out = torch.empty(n, dtype=torch.long)
        token = 0
        choice = torch.randint(0, 4, (n,), generator=gen)
        noise = torch.rand(n, generator=gen) < 0.05
        rand = torch.randint(0, vocab_size, (n,), generator=gen)
        for i in range(n):
            out[i] = token
            token = int(rand[i]) if noise[i] else int(successors[token, int(choice[i])])
        return out

    data = {"train": stream(40_000, 1), "val": stream(4_000, 2)}
    batch_gen = torch.Generator().manual_seed(args.seed)

    def get_batch(split):
        d = data[split]
        ix = torch.randint(len(d) - block_size, (batch_size,), generator=batch_gen)
        x = torch.stack([d[i:i + block_size] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + block_size] for i in ix])
        return x.to(device), y.to(device)

    model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                      vocab_size=vocab_size, dropout=dropout)
    model = GPT(GPTConfig(**model_args))
    model.to(device)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    _logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        # 1) linear warmup for warmup_iters steps
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        # 2) if it > lr_decay_iters, return min learning rate
        if it > lr_decay_iters:
            return min_lr
        # 3) in between, use cosine decay down to min learning rate
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (learning_rate - min_lr)

    loss_log = open(args.loss_log, "w") if args.loss_log else None
    X, Y = get_batch("train")
    t0 = time.time()
    iter_num = 0
    while True:
        lr = get_lr(iter_num) if decay_lr else learning_rate
        if args.fault == "lr" and iter_num >= fault_step:
            lr *= 100
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        if iter_num % eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)

        micro_losses = []
        for micro_step in range(gradient_accumulation_steps):
            if args.fault == "batch" and iter_num == fault_step:
                X = torch.randint_like(X, vocab_size)
                Y = torch.randint_like(Y, vocab_size)
            if args.fault == "nan" and iter_num == fault_step and micro_step == 0:
                model.transformer.wte.weight.data[X[0, 0]] = float("nan")
            with ctx:
                _logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
            if loss_log is not None:
                micro_losses.append(loss.item() * gradient_accumulation_steps)
            # immediately async prefetch next batch while model is doing the forward pass on the GPU
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt = t1 - t0
        t0 = t1
        if loss_log is not None:
            loss_log.write(f"{iter_num} {sum(micro_losses) / len(micro_losses)!r}\n")
        if iter_num % log_interval == 0:
            lossf = loss.item() * gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms", flush=True)
        iter_num += 1
        if iter_num >= max_iters:
            break
    if loss_log is not None:
        loss_log.close()


if __name__ == "__main__":
    main()
