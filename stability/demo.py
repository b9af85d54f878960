"""``stability demo``: train a tiny GPT on the CPU with an injected fault and watch stability diagnose it live.

The training loop below is a plain PyTorch loop; the only stability line is ``import stability.auto`` (done in
:func:`run_demo` after the ``STABILITY_*`` variables are set). Records go to an embedded Redis in the run
directory, a local worker runs the detectors, and live alerts are read back from the findings stream.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

FAULTS = ("none", "bad-batch", "lr-spike", "nan", "divergence")
DEFAULT_FAULT = "lr-spike"

__all__ = ["DEFAULT_FAULT", "FAULTS", "DemoResult", "TinyGPT", "run_demo"]


# --------------------------------------------------------------------------------------------- model and data
class Block(nn.Module):
    """Pre-norm transformer block with explicit attention (so the max attention logit can be observed)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x, logits.detach().amax()


class TinyGPT(nn.Module):
    """A two-layer GPT; ``forward`` returns logits and the per-layer max attention logits."""

    def __init__(self, vocab: int = 64, ctx: int = 32, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        attn_max = []
        for block in self.blocks:
            x, m = block(x)
            attn_max.append(m)
        return self.head(self.ln_f(x)), attn_max


class MarkovData:
    """Sequences from a fixed sparse Markov chain: learnable structure, so the loss falls from ln(vocab)."""

    def __init__(self, vocab: int = 64, ctx: int = 32, batch: int = 32, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.ctx, self.batch, self.gen = vocab, ctx, batch, gen
        succ = torch.stack([torch.randperm(vocab, generator=gen)[:4] for _ in range(vocab)])
        probs = torch.zeros(vocab, vocab)
        probs.scatter_(1, succ, torch.tensor([0.6, 0.25, 0.1, 0.05]).expand(vocab, 4))
        self.probs = probs

    def sample(self) -> torch.Tensor:
        x = torch.empty(self.batch, self.ctx + 1, dtype=torch.long)
        x[:, 0] = torch.randint(self.vocab, (self.batch,), generator=self.gen)
        for t in range(self.ctx):
            x[:, t + 1] = torch.multinomial(self.probs[x[:, t]], 1, generator=self.gen).squeeze(1)
        return x

    def bad_batch(self) -> torch.Tensor:
        """A degenerate batch: long runs of one token, as in a corrupted shard."""
        x = torch.full((self.batch, self.ctx + 1), 7, dtype=torch.long)
        x[:, ::5] = torch.randint(self.vocab, (self.batch, x[:, ::5].shape[1]), generator=self.gen)
        return x


# --------------------------------------------------------------------------------------------- training loop
@dataclass(frozen=True, slots=True, kw_only=True)
class DemoResult:
    """What a demo run produced."""

    run_id: str
    run_dir: Path
    fault: str
    fault_step: int | None
    steps: int
    live_findings: list[dict[str, Any]]
    postmortem: dict[str, Any]


def train(
    *,
    steps: int,
    fault: str,
    fault_step: int,
    lr: float = 3e-3,
    on_step: Callable[[int, float], None] | None = None,
    observe: Callable[[str, torch.Tensor], None] | None = None,
    seed: int = 0,
) -> None:
    """Plain PyTorch training of :class:`TinyGPT` with the chosen fault injected at ``fault_step``."""
    torch.manual_seed(seed)
    data = MarkovData(seed=seed)
    model = TinyGPT(vocab=data.vocab, ctx=data.ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = 30
    for step in range(steps):
        scale = min(1.0, (step + 1) / warmup)
        if fault == "lr-spike" and fault_step <= step < fault_step + 3:
            scale *= 60.0
        if fault == "divergence" and step >= fault_step:
            scale *= 1.06 ** (step - fault_step)
        for group in opt.param_groups:
            group["lr"] = lr * scale
        batch = data.bad_batch() if fault == "bad-batch" and step == fault_step else data.sample()
        logits, attn_max = model(batch[:, :-1])
        if fault == "nan" and step == fault_step:
            logits = logits * torch.tensor(float("nan"))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if observe is not None:
            for i, m in enumerate(attn_max):
                observe(f"attn_logit_max/blocks.{i}", m)
        if on_step is not None:
            on_step(step, float(loss.detach()))  # the demo's own progress display, not stability's hot path


def run_demo(
    *,
    fault: str = DEFAULT_FAULT,
    steps: int = 400,
    run_dir: Path | None = None,
    quiet: bool = False,
) -> DemoResult:
    """Run the demo end to end and return what was found (live and in the post-mortem)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(quiet=quiet)
    run_dir = (run_dir or Path("stability-runs") / f"demo-{fault}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    os.environ.update(
        STABILITY_RUN_DIR=str(run_dir),
        STABILITY_RUN_ID=run_dir.name,
        STABILITY_STATS_EVERY=os.environ.get("STABILITY_STATS_EVERY", "10"),
    )
    os.environ.pop("STABILITY_REDIS_URL", None)
    fault_step = int(steps * 0.6)
    console.print(f"[bold]stability demo[/]: fault [cyan]{fault}[/] at step {fault_step} of {steps}; run dir {run_dir}")

    import stability.auto  # the one line a user adds to a training script

    handle = stability.auto.handle
    if handle is None or handle.redis_url is None:
        raise RuntimeError("stability did not attach; see the log above")
    watcher = _FindingsWatcher(handle.redis_url, handle.run_id, console)
    watcher.start()
    with Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), console=console, transient=False,
    ) as progress:  # fmt: skip
        task = progress.add_task("training", total=steps, loss=float("nan"))
        watcher.console = progress.console
        train(
            steps=steps, fault=fault, fault_step=fault_step, observe=handle.observe,
            on_step=lambda s, loss: progress.update(task, advance=1, loss=loss),
        )  # fmt: skip
    console.print("training done; flushing records and waiting for the worker to drain ...")
    handle.close()
    watcher.stop()
    from stability import postmortem, report

    result = postmortem.run(run_dir, json_out=run_dir / "findings.json", html_out=run_dir / "report.html")
    console.print(report.render_text(result))
    console.print(f"run directory: [bold]{run_dir}[/] (findings.json, report.html, archive/, redis/, worker.log)")
    return DemoResult(
        run_id=handle.run_id, run_dir=run_dir, fault=fault, fault_step=None if fault == "none" else fault_step,
        steps=steps, live_findings=watcher.findings, postmortem=json.loads(result.to_json()),
    )  # fmt: skip


class _FindingsWatcher(threading.Thread):
    """Tails the run's findings stream and prints each alert as it arrives."""

    def __init__(self, url: str, run_id: str, console: Any) -> None:
        super().__init__(daemon=True, name="stability-demo-findings")
        self.url, self.run_id, self.console = url, run_id, console
        self.findings: list[dict[str, Any]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        import redis

        from stability import keys

        client = redis.Redis.from_url(self.url, socket_timeout=2.0)
        last = "0-0"
        while not self._halt.is_set():
            try:
                reply = client.xread({keys.findings(self.run_id): last}, block=200, count=100)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.2)
                continue
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self._show(json.loads(fields[b"f"]))

    def _show(self, finding: dict[str, Any]) -> None:
        self.findings.append(finding)
        colour = {"error": "red", "warning": "yellow"}.get(finding["severity"], "blue")
        cause = finding["causes"][0] if finding.get("causes") else None
        hint = f" — likely [bold]{cause['cause']}[/]: {cause['evidence']}" if cause else ""
        self.console.print(
            f"[{colour}]ALERT {finding['severity'].upper()}[/] {finding['kind']} at step {finding['step']}"
            f" (rank {finding.get('rank', 0)}): {finding['message']}{hint}"
        )

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
