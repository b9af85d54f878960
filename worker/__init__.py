"""The stability worker: drains the record streams of each run, runs the detectors and sends findings to sinks.

Modules: ``drain`` (:class:`~stability.worker.drain.Drainer`, no Celery needed), ``sinks`` (console, Redis
findings stream, Parquet archive), ``wandb_sink`` (W&B diagnosis run), ``app`` / ``tasks`` (Celery), and
``__main__`` (``stability worker``). Nothing is imported here, so ``import stability.worker.drain`` does not load
Celery or W&B.
"""
