"""Runs a test file's `--child` part in a fresh Python process with N fake CPU devices.

`XLA_FLAGS=--xla_force_host_platform_device_count=N` only takes effect before JAX initialises its backend, which
has already happened in a pytest process that ran other tests. So a multi-device test file doubles as a script:
its module fixture calls `run_child(__file__, N)`, the child (`python <file> --child`) runs every case and prints
one JSON line of results as its last line of output, and the tests assert on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def fake_device_env(num_devices: int, env: dict | None = None) -> dict:
    """A copy of `env` (default: this process's environment) whose XLA_FLAGS give `num_devices` fake CPU devices,
    keeping the other flags (the tests' compiler flags of conftest.py), with JAX on the CPU platform."""
    env = dict(os.environ if env is None else env)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={num_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_child(test_file: str, num_devices: int, timeout: float = 1800) -> dict:
    """Runs `python test_file --child` with `num_devices` fake CPU devices; returns the JSON of its last line.

    Fails (AssertionError with the child's output tails) if the child exits non-zero; `timeout` seconds guard
    against a hang (the children take minutes on a busy 2-core machine).
    """
    env = fake_device_env(num_devices)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(Path(test_file).resolve()), "--child"], check=False, env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
