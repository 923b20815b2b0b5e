"""The members of an env group may run on different hosts: a seed must give the same game in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rollstream.shared.envs.registry import default_custom_envs, make_env

ROOT = Path(__file__).resolve().parents[2]
SEEDS = range(0, 1000, 97)
_SCRIPT = """
import json, sys
from rollstream.shared.envs.registry import default_custom_envs, make_env
envs = default_custom_envs()
print(json.dumps({tag: [make_env(tag, envs).reset(seed=s)[0] for s in json.loads(sys.argv[1])] for tag in envs}))
"""


def test_observations_do_not_depend_on_the_process() -> None:
    envs = default_custom_envs()
    here = {tag: [make_env(tag, envs).reset(seed=s)[0] for s in SEEDS] for tag in envs}
    for hash_seed in ("1", "2"):
        # A different PYTHONHASHSEED changes set iteration order for strings; games must not depend on it.
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT, json.dumps(list(SEEDS))],
            capture_output=True, text=True, check=True, env=env, cwd=ROOT, timeout=60,
        )
        assert json.loads(out.stdout) == here
