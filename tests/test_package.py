"""Package-level guarantees: one namespace, a light training-side import, a tested public surface, config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import stability
from stability import WatchConfig
from stability.errors import ConfigError

HEAVY = ("wandb", "celery", "kombu", "sklearn", "statsmodels", "pyarrow", "rich", "pandas")


def _run(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], env=full_env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_training_side_import_is_light(tmp_path: Path, redis_server) -> None:
    """`import stability.auto` attaches (to a private Redis) without importing any worker-side library."""
    code = (
        "import sys, json, stability.auto as a\n"
        "assert a.handle is not None and a.handle.active, 'not attached'\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        "a.handle.close()\n"
    )
    env = {"STABILITY_REDIS_URL": redis_server.url, "STABILITY_RUN_DIR": str(tmp_path / "run")}
    proc = _run(code, env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_cli_import_and_help_are_lazy(tmp_path: Path) -> None:
    """`stability --help` answers without torch, Celery, W&B or redis-py (what made it take seconds)."""
    code = (
        "import sys, json, stability.cli\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n    stability.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(json.dumps([m for m in ('torch', 'celery', 'wandb', 'redis') if m in sys.modules]))\n"
    )
    proc = _run(code, {}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: stability" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_auto_import_defers_redis_until_the_first_step(tmp_path: Path) -> None:
    """`import stability.auto` installs hooks only: redis-py, the transport and the console are imported by the
    session, which opens on the first training step (in the background)."""
    code = (
        "import sys, stability.auto as a\n"
        "assert a.handle is not None and a.handle.active\n"
        "print([m for m in ('redis', 'stability.transport', 'stability.console') if m in sys.modules])\n"
    )
    proc = _run(code, {"STABILITY_RUN_DIR": str(tmp_path / "run")}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert not (tmp_path / "run").exists()


def test_disabled_attaches_nothing(tmp_path: Path) -> None:
    code = "import stability.auto as a, torch\nprint(a.handle.active, torch.Tensor.backward.__module__)\n"
    proc = _run(code, {"STABILITY_DISABLE": "1"}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "torch._tensor"]


@pytest.mark.parametrize("name", ["hooks", "worker", "detectors"])
def test_no_top_level_modules(tmp_path: Path, name: str) -> None:
    """Only `stability` is installed; its subpackages are not importable as top-level modules."""
    proc = _run(f"import {name}", {}, tmp_path)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr
    proc = _run(f"import stability.{name}", {}, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_public_api_is_exactly_all() -> None:
    public = {
        n for n in dir(stability)
        if not n.startswith("_") and not isinstance(getattr(stability, n), types.ModuleType)  # submodules
    } - {"annotations", "TYPE_CHECKING", "Any"}
    assert sorted(stability.__all__) == stability.__all__
    assert public <= set(stability.__all__)
    for name in stability.__all__:
        assert getattr(stability, name) is not None


def test_config_from_env_and_errors() -> None:
    cfg = WatchConfig.from_env({"STABILITY_RUN_ID": "abc", "STABILITY_STATS_EVERY": "7", "STABILITY_DISABLE": "1"})
    assert (cfg.run_id, cfg.stats_every, cfg.enabled) == ("abc", 7, False)
    with pytest.raises(ConfigError, match="STABILITY_STATS_EVERY='x' is not an integer"):
        WatchConfig.from_env({"STABILITY_STATS_EVERY": "x"})
    with pytest.raises(ConfigError, match="STABILITY_LOCAL_WORKER='maybe' is not a boolean"):
        WatchConfig.from_env({"STABILITY_LOCAL_WORKER": "maybe"})
    with pytest.raises(ConfigError, match="redis_url 'http://x' must start with"):
        WatchConfig(redis_url="http://x")
    with pytest.raises(ConfigError, match="stats_every must be >= 0"):
        WatchConfig(stats_every=-1)
    with pytest.raises(ValueError, match="run id 'a b' is invalid"):
        WatchConfig(run_id="a b")
    with pytest.raises(TypeError):
        WatchConfig(unknown_field=1)  # type: ignore[call-arg]
