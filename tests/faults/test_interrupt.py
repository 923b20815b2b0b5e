"""Ctrl-C at the terminal (SIGINT to the whole foreground process group) under `rollstream run`: the workers
report their unfinished episodes, the trainer drains, the embedded Redis is stopped last, nothing is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.faults.conftest import CONFIG, REPO, wait_until


@pytest.mark.slow
def test_ctrl_c_under_run_stops_everything_in_order(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_REDIS_URL"} | {"PYTHONPATH": str(REPO)}
    console = tmp_path / "console.log"
    with open(console, "wb") as f:
        run = subprocess.Popen(
            [sys.executable, "-m", "rollstream", "run", str(CONFIG), "exp_name=faults", f"output_dir={out}",
             "max_steps=100000", "wandb_mode=disabled", "train_env_manager.max_env_num_per_worker=32",
             "actor_infer.strategy_args.strategy_config.delay_s=0.02"],
            env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # a terminal's process group
    try:
        wait_until(lambda: "step 2/" in console.read_text(errors="replace"), 120, "two steps", every_s=0.2)
        os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C does
        interrupted = time.monotonic()
        assert run.wait(timeout=90) == 130
        print(f"\nCtrl-C: everything stopped in {time.monotonic() - interrupted:.1f} s")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()  # reaped here, so a failure does not surface as a ResourceWarning in a later test
    text = console.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    for log in (out / "logs").glob("producer-*.log"):
        body = log.read_text(errors="replace")
        assert "Traceback" not in body and "could not report" not in body, body[-2000:]
        assert "stopped after" in body, body[-2000:]
    left = [p for p in psutil.process_iter(["cmdline"]) if any(str(out) in a for a in p.info["cmdline"] or [])]
    assert not left, left
