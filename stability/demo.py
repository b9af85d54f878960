"""``stability demo``: train a tiny GPT on the CPU with an injected fault and watch stability diagnose it live.

The training loop below is a plain PyTorch loop; the only stability line is ``import stability.auto`` (done in
:func:`run_demo` after the ``STABILITY_*`` variables are set). Records go to an embedded Redis in the run
directory, a local worker runs the detectors, and live alerts are read back from the findings stream.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stability.evaluation.model import MarkovData, TinyGPT, next_token_loss

FAULTS = ("none", "bad-batch", "lr-spike", "nan", "divergence")
DEFAULT_FAULT = "lr-spike"

__all__ = ["DEFAULT_FAULT", "FAULTS", "DemoResult", "run_demo", "train"]


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
    data = MarkovData(batch=32, seed=seed)
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
        logits, attn_max = model(model.embed(batch[:, :-1]))
        if fault == "nan" and step == fault_step:
            logits = logits * torch.tensor(float("nan"))
        loss = next_token_loss((logits, attn_max), batch, observe)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
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
        # the demo shows its own progress bar and alert lines; the terminal reporter would print each alert twice
        STABILITY_QUIET=os.environ.get("STABILITY_QUIET", "1"),
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
        label = "UPDATE" if (finding.get("evidence") or {}).get("revised") else "ALERT"
        self.console.print(
            f"[{colour}]{label} {finding['severity'].upper()}[/] {finding['kind']} at step {finding['step']}"
            f" (rank {finding.get('rank', 0)}{' on ' + finding['host'] if finding.get('host') else ''}):"
            f" {finding['message']}{hint}"
        )

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
