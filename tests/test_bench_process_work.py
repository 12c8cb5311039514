"""``ProcessWork`` (``rl-ckpt bench weights --by-process``): CPU seconds by kind of process, read from /proc."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rl_ckpt.tools.bench.common import ProcessWork

BURN = """
import sys, time
while time.process_time() < 0.3:  # its own CPU time, whatever the machine's load
    pass
print("burnt", flush=True)
sys.stdin.read()  # stays alive (not counted once gone) until the test has read its CPU time
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_cpu_a_process_spent_is_counted_under_its_kind_and_nothing_under_an_idle_one():
    kinds: dict[int, str] = {}
    work = ProcessWork(lambda pid, cmdline: kinds.get(pid) if cmdline.endswith("-child") else None)
    work.start()  # before the children start: each counts from zero, all it spends is counted
    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "idle-child"], stdin=subprocess.PIPE)
    busy = subprocess.Popen(
        [sys.executable, "-c", BURN, "busy-child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    kinds.update({busy.pid: "busy", idle.pid: "idle"})
    try:
        assert busy.stdout.readline().strip() == "burnt"
        got = work.stop()
    finally:
        for child in (busy, idle):
            child.stdin.close()
            child.wait(timeout=60)
    assert set(got) <= {"busy", "idle"}
    assert 0.25 <= got["busy"] < 1.0  # the 0.3 s it burnt (clock ticks of 10 ms) and its interpreter's start-up
    assert got.get("idle", 0.0) < 0.25  # its start-up only
