"""The --in-process pool: a script killed without clean-up (SIGKILL) leaves no worker
behind, so that nothing keeps training (and holding its cores) after the script ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from fedpers.simulations.runs import PARENT_POLL_SECONDS

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from fedpers.simulations.runs import follow_parent

    def work(path):
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)

    if __name__ == "__main__":
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            1, mp_context=context, initializer=follow_parent, initargs=(os.getpid(),)
        ) as pool:
            pool.submit(work, sys.argv[1]).result()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its new parent) is not running
    status = Path(f"/proc/{pid}/stat")
    return not status.exists() or status.read_text().split()[2] != "Z"


def test_a_pool_worker_ends_when_its_script_is_killed(tmp_path: Path) -> None:
    script, marker = tmp_path / "pool_script.py", tmp_path / "worker.pid"
    script.write_text(SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = int(marker.read_text())
        assert _alive(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5 * PARENT_POLL_SECONDS + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the pool worker outlived its killed script"
    finally:
        parent.kill()
        if marker.exists() and marker.read_text() and _alive(int(marker.read_text())):
            os.kill(int(marker.read_text()), signal.SIGKILL)
