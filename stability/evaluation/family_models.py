"""Model families and synthetic tasks of the families corpus (:mod:`stability.evaluation.families`).

Every family is a :class:`Task`: a tiny model plus its data stream, a degenerate batch (``bad``), a way to put a NaN
in the input (``nan``) and a loss. All are CPU-sized (a few ms per step on one thread):

=============  ==========================================================================================
family         model / data
=============  ==========================================================================================
``gpt_s``      2-layer pre-LN GPT, d = 32, learned position embedding, no QK-norm; Zipf-Markov tokens
``gpt_m``      3-layer GPT, d = 64 (another size of the same family)
``moe``        2-layer GPT whose MLP is a top-1 mixture of 4 experts (router softmax, load imbalance)
``lstm``       embedding (256 rows, Zipf-distributed tokens: rare rows get tiny gradients) + LSTM + head
``mlp``        3-layer GELU MLP regressor (MSE) on a random teacher network with noise
``cnn``        2 conv layers + linear classifier of 12x12 synthetic images (oriented bars, 4 classes)
``deep_tanh``  12-16 tanh layers without residuals or normalisation (vanishing gradients), regression
=============  ==========================================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from stability.evaluation.model import TinyGPT

__all__ = ["FAMILIES", "Task", "make_task"]

Observe = Callable[[str, torch.Tensor], None]

FAMILIES = ("gpt_s", "gpt_m", "moe", "lstm", "mlp", "cnn", "deep_tanh")
LM_FAMILIES = frozenset({"gpt_s", "gpt_m", "moe", "lstm"})
ATTENTION_FAMILIES = frozenset({"gpt_s", "gpt_m", "moe"})


class ZipfMarkov:
    """Tokens of a lag-1 Markov chain whose unigram distribution is Zipfian: with probability 0.7 the next token is
    one of two fixed successors of the current one, else a fresh draw from Zipf(1.1) over the vocabulary (so the
    highest ids are rare and their embedding rows see tiny, sporadic gradients)."""

    def __init__(self, *, vocab: int, ctx: int, batch: int, seed: int, stream: int) -> None:
        chain = torch.Generator().manual_seed(30_000 + seed)
        self.gen = torch.Generator().manual_seed(40_000 + 1000 * seed + stream)
        self.vocab, self.ctx, self.batch = vocab, ctx, batch
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        self.zipf = (ranks ** -1.1 / (ranks ** -1.1).sum()).float()
        self.succ = torch.multinomial(self.zipf.expand(vocab, vocab), 2, generator=chain)

    def sample(self) -> torch.Tensor:
        x = torch.empty(self.batch, self.ctx + 1, dtype=torch.long)
        x[:, 0] = torch.multinomial(self.zipf, self.batch, replacement=True, generator=self.gen)
        follow = torch.rand(self.batch, self.ctx, generator=self.gen) < 0.7
        which = torch.randint(2, (self.batch, self.ctx), generator=self.gen)
        fresh = torch.multinomial(self.zipf, self.batch * self.ctx, replacement=True,
                                  generator=self.gen).view(self.batch, self.ctx)
        for t in range(self.ctx):
            nxt = self.succ[x[:, t], which[:, t]]
            x[:, t + 1] = torch.where(follow[:, t], nxt, fresh[:, t])
        return x

    def bad(self, strength: float) -> torch.Tensor:
        """Uniformly random tokens in a ``strength`` fraction of the rows (a corrupted shard)."""
        x = self.sample()
        rows = max(1, round(strength * self.batch))
        x[:rows] = torch.randint(self.vocab, (rows, self.ctx + 1), generator=self.gen)
        return x


class MoEBlock(nn.Module):
    """Pre-LN attention block whose MLP is a top-1 mixture of experts."""

    def __init__(self, d: int, heads: int, experts: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        h = self.ln2(x)
        gate = self.router(h).softmax(dim=-1)
        top, idx = gate.max(dim=-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = (idx == e).to(h.dtype)
            out = out + sel * top * expert(h)
        return x + out, logits.detach().masked_fill(~mask, float("-inf")).amax()


class TinyMoE(TinyGPT):
    """GPT with mixture-of-experts MLPs; ``forward`` returns logits and each block's max attention logit."""

    def __init__(self, *, vocab: int, ctx: int, d: int = 32, layers: int = 2, heads: int = 2, experts: int = 4
                 ) -> None:
        self.experts = experts  # read by _block while TinyGPT builds the blocks
        super().__init__(vocab=vocab, ctx=ctx, d=d, layers=layers, heads=heads)

    def _block(self, d: int, heads: int, qk_norm: bool) -> nn.Module:
        return MoEBlock(d, heads, self.experts)


class LSTMLM(nn.Module):
    """Embedding + one-layer LSTM + linear head (the word-language-model shape)."""

    def __init__(self, *, vocab: int, d: int = 48) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        y, _ = self.rnn(x)
        return self.head(y), []


class Task:
    """One family: model, data stream, degenerate batch, NaN injection and loss."""

    def __init__(self, family: str, *, seed: int, stream: int = 0, depth: int = 12, init_std: float = 0.02,
                 attn_group: bool = False) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}")
        self.family = family
        self.gen = torch.Generator().manual_seed(50_000 + 1000 * seed + stream)
        torch.manual_seed(seed)  # identical initial weights on every replica
        self.model: nn.Module
        self.lm: ZipfMarkov | None = None
        if family in LM_FAMILIES:
            vocab = 256 if family == "lstm" else 96
            self.lm = ZipfMarkov(vocab=vocab, ctx=24, batch=12, seed=seed, stream=stream)
            if family == "gpt_s":
                self.model = TinyGPT(vocab=vocab, ctx=24, d=32, layers=2, heads=2)
            elif family == "gpt_m":
                self.model = TinyGPT(vocab=vocab, ctx=24, d=64, layers=3, heads=4)
            elif family == "moe":
                self.model = TinyMoE(vocab=vocab, ctx=24)
            else:
                self.model = LSTMLM(vocab=vocab)
        elif family == "cnn":
            self.model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                       nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                       nn.Flatten(), nn.Linear(16 * 9, 4))
            base = torch.zeros(4, 12, 12)
            base[0, 5:7, :] = 1
            base[1, :, 5:7] = 1
            base[2] = torch.eye(12)
            base[3] = torch.eye(12).flip(1)
            self.images = base
        else:
            teacher_gen = torch.Generator().manual_seed(60_000 + seed)
            self.w1 = torch.randn(16, 32, generator=teacher_gen) / 4
            self.w2 = torch.randn(32, 4, generator=teacher_gen) / math.sqrt(32)
            if family == "mlp":
                self.model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                           nn.Linear(64, 4))
            else:
                layers: list[nn.Module] = [nn.Linear(16, 48), nn.Tanh()]
                for _ in range(depth):
                    lin = nn.Linear(48, 48)
                    nn.init.normal_(lin.weight, std=init_std)
                    nn.init.zeros_(lin.bias)
                    layers += [lin, nn.Tanh()]
                layers.append(nn.Linear(48, 4))
                self.model = nn.Sequential(*layers)
        self.attn_group = attn_group

    # ---------------------------------------------------------------- data
    def sample(self) -> Any:
        if self.lm is not None:
            return self.lm.sample()
        if self.family == "cnn":
            y = torch.randint(4, (24,), generator=self.gen)
            x = self.images[y] + 0.6 * torch.randn(24, 12, 12, generator=self.gen)
            return x.unsqueeze(1), y
        x = torch.randn(32, 16, generator=self.gen)
        y = torch.tanh(x @ self.w1) @ self.w2 + 0.05 * torch.randn(32, 4, generator=self.gen)
        return x, y

    def bad(self, strength: float, *, constant: bool = False) -> Any:
        """A degenerate batch; ``strength`` in (0, 1]: the corrupted fraction (LM: random-token rows), or a scale
        (vision: labels shuffled and contrast x ``1 + 9 strength``; regression: targets + noise x ``30 strength``).
        ``constant`` (LMs): every position is token ``strength * (vocab - 1)`` (0 is the most frequent)."""
        if self.lm is not None:
            if constant:
                token = round(min(1.0, max(0.0, strength)) * (self.lm.vocab - 1))
                return torch.full((self.lm.batch, self.lm.ctx + 1), token, dtype=torch.long)
            return self.lm.bad(min(1.0, strength))
        x, y = self.sample()
        if self.family == "cnn":
            return x * (1 + 9 * strength), y[torch.randperm(len(y), generator=self.gen)]
        return x, y + 30 * strength * torch.randn(y.shape, generator=self.gen)

    # ---------------------------------------------------------------- loss
    def loss(self, batch: Any, observe: Observe | None, *, nan: bool = False, bf16: bool = False,
             grad_hook: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The loss of ``batch`` (fp32), observing each attention block's max logit; ``nan``: a NaN in one input
        value; ``grad_hook``: applied to the gradient of the model output (fp16 overflow injection)."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if self.lm is not None:
                embed: Callable[[torch.Tensor], torch.Tensor] = self.model.embed  # type: ignore[assignment]
                x = embed(batch[:, :-1])
                logits, attn_max = self.model(self._inject(x, nan))
                logits = self._hook(logits, grad_hook)
                if observe is not None:
                    for i, m in enumerate(attn_max):
                        observe(f"attn_logit_max/blocks.{i}", m.float())
                return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            x, y = batch
            out = self._hook(self.model(self._inject(x, nan)).float(), grad_hook)
            if self.family == "cnn":
                return F.cross_entropy(out, y)
            return F.mse_loss(out, y)

    @staticmethod
    def _inject(x: torch.Tensor, nan: bool) -> torch.Tensor:
        if nan:
            x = x.clone()
            x.view(x.shape[0], -1)[0, 3] = float("nan")
        return x

    @staticmethod
    def _hook(out: torch.Tensor, grad_hook: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        if grad_hook is not None:
            out.register_hook(grad_hook)  # type: ignore[no-untyped-call]
        return out


def make_task(family: str, **kwargs: Any) -> Task:
    """A :class:`Task` for ``family`` (see the module table)."""
    return Task(family, **kwargs)
