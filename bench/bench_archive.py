"""Archive write cost: records/s of :class:`~stability.worker.sinks.ArchiveSink` against the old layout.

Run: ``python bench/bench_archive.py [--records 20000] [--signals 170] [--batch 500]``.

Both write the same batches of one rank into a temporary directory:

* ``parquet part per batch`` (baseline, the layout before segments): ``pyarrow.parquet.write_table`` of each batch
  to its own file (temporary name + rename);
* ``segment tail``: ``ArchiveSink.emit`` (one LZ4 Arrow IPC frame appended to the rank's tail) and ``sync`` (fsync)
  every 10 batches, as the drainer commits, plus the final roll into Parquet at ``close``; once with entries that
  carry only their record (the table is built from the signal dicts) and once with the packed values the drainer
  passes (``Entry.packed``, from ``records.decode_packed``).

Printed: records/s of each, the ratio to the baseline and the files left, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from stability.records import StepRecord, decode_packed, encode
from stability.worker.sinks import ArchiveSink, Entry, archive_table


def batches(records: int, signals: int, batch: int) -> list[list[Entry]]:
    rng = random.Random(0)
    names = [f"grad_norm/model.layers.{i}" for i in range(signals - 1)] + ["loss"]
    out: list[list[Entry]] = []
    for start in range(0, records, batch):
        out.append([
            Entry(entry_id=f"{1_700_000_000_000 + s * 1000}-{s}", rank=0,
                  record=StepRecord(run_id="bench", step=s, wall_time=1.7e9 + s,
                                    signals={n: rng.random() for n in names}))
            for s in range(start, min(start + batch, records))
        ])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--signals", type=int, default=170)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()
    data = batches(args.records, args.signals, args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        start = time.perf_counter()
        for entries in data:
            path = old / f"part-0-{entries[0].entry_id}.parquet"
            pq.write_table(archive_table("bench", entries), str(path) + ".tmp")
            os.replace(str(path) + ".tmp", path)
        t_old = time.perf_counter() - start

        n = args.records
        print(f"{n} records x {args.signals} signals, batches of {args.batch}")
        print(f"parquet part per batch: {n / t_old:>9,.0f} records/s  1.000x  ({len(list(old.iterdir()))} files)")
        packed = [[Entry(entry_id=e.entry_id, rank=e.rank, record=r, packed=p)
                   for e in entries for r, p in [decode_packed(encode(e.record))]] for entries in data]
        for label, batches_ in (("signal dicts", data), ("packed values", packed)):
            run_dir = Path(tmp) / label.replace(" ", "-")
            run_dir.mkdir()
            sink = ArchiveSink(lambda run_id, d=run_dir: {"run_dir": str(d)})
            start = time.perf_counter()
            for i, entries in enumerate(batches_):
                sink.emit("bench", [], entries)
                if i % 10 == 9:
                    sink.sync("bench")
            t_emit = time.perf_counter() - start
            sink.close("bench")
            t_new = time.perf_counter() - start
            print(f"segment tail from {label} (emit+sync): {n / t_emit:>7,.0f} records/s  {t_old / t_emit:.3f}x")
            print(f"  + roll into Parquet at close: {n / t_new:>7,.0f} records/s  {t_old / t_new:.3f}x  "
                  f"({len(list((run_dir / 'archive').iterdir()))} files)")


if __name__ == "__main__":
    main()
