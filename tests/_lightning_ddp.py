"""Lightning DDP with 2 CPU processes (gloo), run by tests/test_lightning.py as ``python _lightning_ddp.py OUT``.

Lightning re-launches this script for rank 1. Each rank trains with a ``StabilityCallback`` feeding a Capture
with a ListSink, and writes its records and reference values (loss, pre-clip grad norm) to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as L
import torch
from test_lightning import Regressor, loader

from stability.config import WatchConfig
from stability.hooks.capture import Capture
from stability.hooks.lightning import callback_class
from stability.testing import ListSink


def main(out_dir: Path) -> None:
    sink = ListSink()
    capture = Capture(WatchConfig(run_id="pl-ddp", stats_every=0), sink).attach()
    module = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback_class("lightning.pytorch")(capture)],
    )
    trainer.fit(module, loader())
    capture.close()
    records = [
        {"step": r.step, "rank": r.rank, "batch": r.batch, "signals": dict(r.signals), "coords": dict(r.coords)}
        for r in sorted(sink.records, key=lambda r: r.step)
    ]
    payload = {"records": records, "losses": module.losses, "grad_norms": module.grad_norms}
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))
    assert torch.distributed.is_initialized()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
