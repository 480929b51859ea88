"""``bench.stall_probe``: the figures of a sleeping probe's lateness, the probe process itself (a
real subprocess, stopped by SIGTERM, answering with those figures), the kernel's autogroup switch,
and a stack's processes kept in the benchmark's session (one scheduling group with the client)."""

from __future__ import annotations

import os
import sys
import time

from bench.peers_stacks import Stack, StackSpec
from bench.stall_probe import HostStallProbe, sched_autogroup, summarise


def test_the_figures_count_stalls_from_100_ms_and_the_time_they_lost():
    late = [0.1] * 97 + [99.9, 100.0, 1_250.0]
    assert summarise(late) == {"wakeups": 100, "late_ms_max": 1250.0, "late_ms_p99": 1250.0,
                               "stalls": 2, "stalled_s": 1.35}
    assert summarise([]) == {"wakeups": 0, "late_ms_max": 0.0, "late_ms_p99": 0.0, "stalls": 0,
                             "stalled_s": 0.0}


def test_the_probe_process_answers_when_stopped():
    with HostStallProbe() as probe:
        time.sleep(1.0)
    result = probe.result
    assert result is not None and set(result) == {"wakeups", "late_ms_max", "late_ms_p99",
                                                  "stalls", "stalled_s"}
    assert result["wakeups"] > 10  # it slept in 10 ms steps for most of that second


def test_a_stacks_process_runs_in_its_own_group_and_the_benchmarks_session(tmp_path):
    spec = StackSpec("smg-round_robin", "smg", smg_policy="round_robin")
    stack = Stack(spec, model=None, log_dir=tmp_path)
    stack._spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (pid,) = stack.pids()
        assert os.getpgid(pid) == pid
        assert os.getsid(pid) == os.getsid(0)
    finally:
        stack.stop()
    assert stack.pids() == []


def test_autogroup_is_read_from_the_kernels_switch(tmp_path):
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("1\n")
    assert sched_autogroup(switch) is True
    switch.write_text("0\n")
    assert sched_autogroup(switch) is False
    assert sched_autogroup(tmp_path / "absent") is None
