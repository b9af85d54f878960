"""FSDP2 (``fully_shard``: parameters, gradients and Adam's state are ``DTensor`` shards) with two real gloo
processes on the CPU: the capture measures each rank's shard without a collective and without touching training."""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path

import pytest

from stability.records import SHARDED, StepRecord
from stability.testing import diagnose, torchrun

pytestmark = pytest.mark.skipif(not hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard"),
                                reason="FSDP2 (fully_shard) needs torch >= 2.6")

STEPS = 12


def _run(out: Path, kind: str) -> dict[int, dict]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "STABILITY_WATCHDOG": "0"}
    proc = torchrun(Path(__file__).with_name("_fsdp_worker.py"), str(out), kind, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    return _run(tmp_path_factory.mktemp("fsdp2"), "fsdp2")


def test_every_step_is_recorded_with_its_shards_statistics(ranks: dict[int, dict]) -> None:
    assert sorted(ranks) == [0, 1]
    for rank, data in ranks.items():
        assert data["errors"] == 0
        recs = data["records"]
        assert [r["step"] for r in recs] == list(range(STEPS))
        for r, ref in zip(recs, data["seen"], strict=True):
            s = r["signals"]
            assert r["rank"] == rank and r["coords"][SHARDED] == 1
            assert math.isclose(s["loss"], ref["loss"], rel_tol=1e-6)
            # the whole model's norm, as torch's clip returned it (all ranks agree); per module, this rank's shard's,
            # before clipping
            assert math.isclose(s["grad_norm"], ref["total"], rel_tol=1e-6) and ref["total"] > 0.1, (s, ref)
            assert s["nonfinite_grads"] == 0
            if r["step"] % 2 == 0:
                shard = math.sqrt(sum(v * v for k, v in s.items() if k.startswith("grad_norm/")))
                assert math.isclose(shard, ref["local_grad_norm"], rel_tol=1e-5), (shard, ref)
                assert shard < ref["total"]
        sampled = [r["signals"] for r in recs if r["step"] % 2 == 0 and r["step"] > 0]
        for quantity in ("grad_norm", "param_norm", "update_ratio", "adam_v_ratio", "act_rms"):
            values = [v for s in sampled for k, v in s.items() if k.startswith(quantity + "/")]
            assert values and all(math.isfinite(v) and v > 0 for v in values), quantity
    # the shards differ, so their norms differ by rank; the whole model's is the same on both
    one, two = ranks[0]["records"][4]["signals"], ranks[1]["records"][4]["signals"]
    assert one["grad_norm/0.0"] != two["grad_norm/0.0"] and one["grad_norm"] == two["grad_norm"]


def test_training_is_unchanged_by_the_capture(ranks: dict[int, dict]) -> None:
    """torch's own clipping runs (with the whole model's norm), not a clip with this rank's shard norm."""
    assert all(data["training_unchanged"] for data in ranks.values())


def test_adam_statistic_reads_the_clipped_gradients(ranks: dict[int, dict]) -> None:
    """The in-place clip of DTensor gradients bumps no version counter: Adam's ``g^2 / v`` must be taken from the
    gradients as the optimizer saw them (clipped to 0.1 from norms 2-5x that: the pre-clip norms would
    make it several times larger)."""
    compared = 0
    for data in ranks.values():
        for r, ref in zip(data["records"], data["seen"], strict=True):
            for module, expected in ref["adam_v_ratio"].items():
                got = r["signals"].get(f"adam_v_ratio/{module}")
                if got is not None and r["step"] % 2 == 0:
                    assert math.isclose(got, expected, rel_tol=1e-3), (r["step"], module, got, expected)
                    compared += 1
    assert compared >= 20


def test_a_clean_sharded_run_raises_nothing(ranks: dict[int, dict]) -> None:
    records = [StepRecord(run_id="fsdp-two", step=r["step"], rank=r["rank"], coords=r["coords"], signals=r["signals"])
               for data in ranks.values() for r in data["records"]]
    findings, _ = diagnose(sorted(records, key=lambda r: (r.step, r.rank)))
    assert [f for f in findings if f.severity.value in ("warning", "error")] == []


def test_fsdp1_records_the_whole_models_norm_and_the_users_module_names(tmp_path: Path) -> None:
    """FSDP1 (``FullyShardedDataParallel``, ``use_orig_params``): its own ``clip_grad_norm_`` is followed (the
    whole model's norm it returns is ``grad_norm``), module names drop ``_fsdp_wrapped_module``, training is
    unchanged and a clean run raises nothing."""
    ranks = _run(tmp_path, "fsdp1")
    assert sorted(ranks) == [0, 1]
    for data in ranks.values():
        assert data["errors"] == 0 and data["training_unchanged"]
        recs = data["records"]
        assert [r["step"] for r in recs] == list(range(STEPS))
        for r, ref in zip(recs, data["seen"], strict=True):
            assert r["coords"][SHARDED] == 1
            assert math.isclose(r["signals"]["grad_norm"], ref["total"], rel_tol=1e-6), (r["signals"], ref)
        names = {k.split("/", 1)[1] for r in recs for k in r["signals"] if k.startswith("grad_norm/")}
        assert names == {"0.0", "0.2", "1.0", "1.2", "2"}, names
    test_a_clean_sharded_run_raises_nothing(ranks)
