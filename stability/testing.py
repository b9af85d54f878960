"""Test doubles shipped with the library: an in-memory record sink and a tiny GPT for CPU training tests.

::

    sink = ListSink()
    capture = Capture(WatchConfig(run_id="t"), sink).attach()
    ...train...
    capture.close()
    losses = [r.get("loss") for r in sink.records]
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stability.records import StepRecord

if TYPE_CHECKING:
    from stability.config import WatchConfig
    from stability.detectors.base import Finding
    from stability.detectors.engine import DiagnoserConfig, RunDiagnoser

__all__ = ["ListSink", "TinyGPT", "TinyGPTConfig", "capture_loop", "diagnose", "diagnose_split", "saving_checkpoint",
           "torchrun"]


class ListSink:
    """A record sink that keeps every record in memory, in arrival order (thread-safe).

    Args:
        accept: what :meth:`put` returns (False imitates a full transport queue; the record is still kept).
    """

    def __init__(self, *, accept: bool = True) -> None:
        self._records: list[StepRecord] = []
        self._lock = threading.Lock()
        self.accept = accept

    def put(self, record: StepRecord) -> bool:
        """Keep ``record``; return :attr:`accept`."""
        with self._lock:
            self._records.append(record)
        return self.accept

    @property
    def records(self) -> list[StepRecord]:
        """A copy of the records received so far."""
        with self._lock:
            return list(self._records)

    def series(self, name: str) -> list[float]:
        """Signal ``name`` over the records that have it, in step order."""
        return [r.signals[name] for r in sorted(self.records, key=lambda r: r.step) if name in r.signals]

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyGPTConfig:
    """Size of :class:`TinyGPT`; the defaults are the 4-layer d=256 model of ``bench/bench_overhead.py``."""

    vocab: int = 1024
    block: int = 128
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    return_dict: bool = False
    """Return ``{"logits": ...}`` instead of the logits tensor (so ``logit_z`` can be captured)."""


class _Attention(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = _Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class TinyGPT(nn.Module):
    """A small GPT-2-style language model (pre-LayerNorm blocks, untied output head)."""

    def __init__(self, cfg: TinyGPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TinyGPTConfig()
        c = self.cfg
        self.wte = nn.Embedding(c.vocab, c.d_model)
        self.wpe = nn.Embedding(c.block, c.d_model)
        self.h = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return {"logits": logits} if self.cfg.return_dict else logits


def capture_loop(config: WatchConfig, steps: int, before_step: Callable[[int, Any], None] = lambda step, capture: None,
                 *, model: nn.Module | None = None, compute_s: float = 0.02) -> list[StepRecord]:
    """Train ``model`` (default: one ``Linear(32, 1)``) for ``steps`` SGD steps under a :class:`Capture` with
    ``config`` and return its records. Each forward sleeps ``compute_s`` (the step's compute); ``before_step(step,
    capture)`` runs before each step's forward (a data loader's wait, a profile request, ...). The hang watchdog is
    off (``STABILITY_WATCHDOG=0`` is set for the rest of the process)."""
    import time

    from stability.hooks.capture import Capture

    torch.manual_seed(0)
    model = model if model is not None else nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.register_forward_hook(lambda module, args, output: time.sleep(compute_s))
    sink = ListSink()
    os.environ["STABILITY_WATCHDOG"] = "0"
    capture = Capture(config, sink)
    capture.attach(model, opt)
    try:
        for step in range(steps):
            before_step(step, capture)
            model(torch.randn(16, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        capture.close()
    return list(sink.records)


def torchrun(script: Path | str, *args: str, nproc: int = 2, env: Mapping[str, str] | None = None,
             timeout: float = 240, launcher: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` under ``python -m torch.distributed.run`` with ``nproc`` local processes on a free port
    (``launcher``: more torchrun options, e.g. ``("--log-dir", D, "--tee", "3")``).

    The environment is ``env`` (default: this process's) without the torchrun variables a parent job may have set,
    with ``OMP_NUM_THREADS=1`` unless given. Output is captured; the caller checks ``returncode``."""
    from stability.embedded import free_port

    base = {k: v for k, v in (os.environ if env is None else env).items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *launcher, str(script), *args]
    return subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=timeout)


@contextmanager
def saving_checkpoint(timeout: float = 30.0) -> Iterator[int]:
    """A thread stuck inside ``torch.save`` (its file's ``write`` waits) for the ``with`` block; yields its ident.

    It is inside ``torch/serialization.py`` when the block starts (what the watchdog's checkpoint-save test looks
    for); it finishes the save when the block ends."""
    import io
    import time

    release = threading.Event()

    class _SlowFile(io.BytesIO):
        def write(self, data: Any) -> int:
            release.wait(timeout)
            return super().write(data)

    saver = threading.Thread(target=torch.save, args=({"w": torch.zeros(4)}, _SlowFile()), daemon=True)
    saver.start()
    ident = saver.ident
    assert ident is not None
    deadline = time.monotonic() + timeout
    while not _inside(ident, "torch/serialization.py"):
        if time.monotonic() > deadline:
            raise TimeoutError("the saver thread did not reach torch.save")
        time.sleep(0.01)
    try:
        yield ident
    finally:
        release.set()
        saver.join(timeout)


def _inside(ident: int, filename: str) -> bool:
    frame = sys._current_frames().get(ident)
    while frame is not None:
        if filename in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def diagnose(records: list[StepRecord], config: DiagnoserConfig | None = None) -> tuple[list[Finding], RunDiagnoser]:
    """Every finding of one :class:`~stability.detectors.engine.RunDiagnoser` fed ``records`` in order (with
    ``finish()``), and the diagnoser."""
    from stability.detectors.engine import RunDiagnoser

    diag = RunDiagnoser(config)
    found = [f for record in records for f in diag.update(record)]
    return found + diag.finish(), diag


def diagnose_split(records: list[StepRecord], split: int) -> list[Finding]:
    """:func:`diagnose`'s findings when a worker stops after ``records[:split]`` and a fresh diagnoser resumes from
    the first one's state sent through msgpack (as the worker's snapshots are)."""
    import msgpack

    from stability.detectors.engine import RunDiagnoser

    first = RunDiagnoser()
    found = [f for record in records[:split] for f in first.update(record)]
    second = RunDiagnoser()
    second.load_state_dict(msgpack.unpackb(msgpack.packb(first.state_dict(), use_bin_type=True), raw=False))
    return found + [f for record in records[split:] for f in second.update(record)] + second.finish()
