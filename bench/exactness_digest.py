"""sha1s of the detector suite's findings and ``state_dict`` (msgpack) on fixed inputs, to prove an optimisation exact.

Run it on two commits and diff the output: every line must stay the same. ::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/exactness_digest.py [name filter ...]

Inputs: ``bench/_records.py`` records (seeds 0-2; 206 and 21 signals; 1 and 3 ranks; injected NaN, spike and
layer-gradient anomalies; seed 1 adds a falling ``loss_scale`` with jumps, seed 2 has stats every 10 steps), the
``bench_postmortem`` synthetic CSVs, and every real run in ``/work/shared/data/real-runs`` (through
``load_source`` + ``analyze``, and the records fed to a bare ``RunDiagnoser``). Per case: findings, state half-way
and state at the end (and for the files the post-mortem's incidents, alerts and log events first).
"""

from __future__ import annotations

import glob
import hashlib
import pathlib
import random
import sys
import tempfile
from typing import Any

import msgpack

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _records import RecordFactory
from bench_postmortem import write_csv

from stability.detectors.engine import RunDiagnoser
from stability.postmortem import analyze, load_source
from stability.records import StepRecord

REAL_RUNS = "/work/shared/data/real-runs/*.csv"


def _sha(obj: Any) -> str:
    return hashlib.sha1(repr(obj).encode()).hexdigest()[:12]


def _state_sha(diagnoser: RunDiagnoser) -> str:
    return hashlib.sha1(msgpack.packb(diagnoser.state_dict(), use_bin_type=True, default=repr)).hexdigest()[:12]


def _run(records: list[StepRecord]) -> str:
    diagnoser = RunDiagnoser()
    found = []
    mid = ""
    for i, record in enumerate(records):
        found.extend(diagnoser.update(record))
        if i == len(records) // 2:
            mid = _state_sha(diagnoser)
    found.extend(diagnoser.finish())
    return f"{_sha(found)} {mid} {_state_sha(diagnoser)}"


def _with_scale(record: StepRecord, step: int) -> StepRecord:
    signals = dict(record.signals)
    signals["loss_scale"] = 2.0 ** (16 - step // 700 + (1 if step % 97 == 0 else 0))
    return StepRecord(run_id=record.run_id, step=record.step, rank=record.rank, wall_time=record.wall_time,
                      host=record.host, coords=record.coords, signals=signals)


def _bench_cases() -> dict[str, list[StepRecord]]:
    cases = {}
    for seed in (0, 1, 2):
        for modules in (40, 3):
            steps = 1500 if modules == 40 else 4000
            for ranks in ((0,), (0, 1, 2)) if modules == 3 else ((0,),):
                factories = [RecordFactory(run_id="x", rank=k, modules=modules, seed=seed, total_steps=steps,
                                           stats_every=1 if seed != 2 else 10) for k in ranks]
                rng = random.Random(seed)
                records = []
                for step in range(steps):
                    for factory in factories:
                        anomaly = None
                        if step > 300 and rng.random() < 0.004:
                            anomaly = rng.choice(["nan", "layer_grad", "spike"])
                        record = factory.record(step, 1000.0 + step, anomaly=anomaly)
                        records.append(_with_scale(record, step) if seed == 1 else record)
                cases[f"bench s{seed} m{modules} r{len(ranks)}"] = records
    return cases


def main() -> None:
    only = sys.argv[1:]
    for name, records in _bench_cases().items():
        if not only or any(o in name for o in only):
            print(name, _run(records), flush=True)
    tmp = pathlib.Path(tempfile.mkdtemp())
    write_csv(tmp / "pm.csv", 20000, 4)
    write_csv(tmp / "pm100.csv", 3000, 100)
    for path in [str(tmp / "pm.csv"), str(tmp / "pm100.csv"), *sorted(glob.glob(REAL_RUNS))]:
        name = pathlib.Path(path).name
        if only and not any(o in name for o in only):
            continue
        log = load_source(path, loss_averaged=False)
        result = analyze(log.records, "b", segments=log.segments, events=log.events, progress=False)
        ordered = sorted(log.records, key=lambda r: (r.step, r.rank))
        print(name, len(log.records), _sha((result.incidents, result.alerts, result.log_events)), _run(ordered),
              flush=True)


if __name__ == "__main__":
    main()
