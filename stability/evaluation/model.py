"""Tiny models and data for the evaluation corpus: a GPT with observable attention logits and a deep MLP LM.

Everything is CPU-sized (vocab 64, context 32, width 64) so that a few hundred steps train in a couple of seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DeepMLP", "MarkovData", "TinyGPT", "next_token_loss"]


class MarkovData:
    """Token sequences from a fixed sparse lag-2 Markov chain (token t+1 depends on token t-1).

    Learnable (the loss falls from ln(vocab)), and only through attention to the previous position, so broken
    attention shows in the loss.
    """

    def __init__(self, *, vocab: int = 64, ctx: int = 32, batch: int = 16, seed: int = 0, stream: int = 0) -> None:
        chain = torch.Generator().manual_seed(10_000 + seed)
        self.gen = torch.Generator().manual_seed(20_000 + 1000 * seed + stream)
        self.vocab, self.ctx, self.batch = vocab, ctx, batch
        succ = torch.stack([torch.randperm(vocab, generator=chain)[:4] for _ in range(vocab)])
        probs = torch.zeros(vocab, vocab)
        probs.scatter_(1, succ, torch.tensor([0.6, 0.25, 0.1, 0.05]).expand(vocab, 4))
        self.probs = probs

    def sample(self) -> torch.Tensor:
        """One batch ``(batch, ctx + 1)`` of token ids."""
        x = torch.empty(self.batch, self.ctx + 1, dtype=torch.long)
        x[:, :2] = torch.randint(self.vocab, (self.batch, 2), generator=self.gen)
        for t in range(1, self.ctx):
            x[:, t + 1] = torch.multinomial(self.probs[x[:, t - 1]], 1, generator=self.gen).squeeze(1)
        return x

    def bad_batch(self) -> torch.Tensor:
        """A degenerate batch (uniformly random tokens, as from a corrupted shard): high loss, no structure."""
        return torch.randint(self.vocab, (self.batch, self.ctx + 1), generator=self.gen)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.q_norm = nn.LayerNorm(d // heads) if qk_norm else None
        self.k_norm = nn.LayerNorm(d // heads) if qk_norm else None
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x, logits.detach().masked_fill(~mask, float("-inf")).amax()


class TinyGPT(nn.Module):
    """Pre-LN GPT; ``forward`` returns the logits and the max attention logit of each block (device tensors)."""

    def __init__(self, *, vocab: int = 64, ctx: int = 32, d: int = 64, layers: int = 2, heads: int = 4,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(self._block(d, heads, qk_norm) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def _block(self, d: int, heads: int, qk_norm: bool) -> nn.Module:
        """One transformer block (subclasses swap the MLP, e.g. for experts)."""
        return _Block(d, heads, qk_norm)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings."""
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``x``: embeddings ``(b, t, d)`` from :meth:`embed` (so a loop can corrupt them, e.g. with NaN)."""
        attn_max = []
        for block in self.blocks:
            x, m = block(x)
            attn_max.append(m)
        return self.head(self.ln_f(x)), attn_max


class DeepMLP(nn.Module):
    """A deep tanh MLP language model without residuals or normalisation (prone to vanishing gradients)."""

    def __init__(self, *, vocab: int = 64, ctx: int = 32, d: int = 64, layers: int = 8, init_std: float = 0.02
                 ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        linears = [nn.Linear(d, d) for _ in range(layers)]
        head = nn.Linear(d, vocab)
        for layer in linears:
            nn.init.normal_(layer.weight, std=init_std)
            nn.init.zeros_(layer.bias)
        self.layers = nn.ModuleList(linears)
        self.head = head

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings."""
        return self.tok(idx)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits and no attention statistics."""
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x), []


def next_token_loss(
    output: tuple[torch.Tensor, list[torch.Tensor]],
    batch: torch.Tensor,
    observe: Callable[[str, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Cross-entropy of a model's ``(logits, attention maxima)`` output against ``batch[:, 1:]``.

    Each block's max attention logit goes to ``observe`` as ``attn_logit_max/blocks.<i>`` (models expose it; the
    capture does not guess it).
    """
    logits, attn_max = output
    if observe is not None:
        for i, m in enumerate(attn_max):
            observe(f"attn_logit_max/blocks.{i}", m)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
