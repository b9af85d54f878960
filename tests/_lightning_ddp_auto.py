"""`import stability.auto` + Lightning DDP with 2 CPU processes and the embedded Redis: run by tests/test_lightning.py.

Lightning re-launches this script for rank 1 after `fit()` starts; that process must join the run of rank 0 (same
run id and run directory, inherited through the environment) and write its own rank's stream.
"""

from __future__ import annotations

import sys
from pathlib import Path

import stability.auto  # noqa: F401  - the one line a user adds

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as L
from test_lightning import Regressor, loader

if __name__ == "__main__":
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Regressor(), loader())
