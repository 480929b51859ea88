"""``bench.stall_probe``: the figures of a sleeping probe's lateness, the probe process itself (a
real subprocess, stopped by SIGTERM, answering with those figures), and the kernel's autogroup
switch."""

from __future__ import annotations

import time

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


def test_autogroup_is_read_from_the_kernels_switch(tmp_path):
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("1\n")
    assert sched_autogroup(switch) is True
    switch.write_text("0\n")
    assert sched_autogroup(switch) is False
    assert sched_autogroup(tmp_path / "absent") is None
