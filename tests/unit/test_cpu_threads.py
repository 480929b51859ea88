"""engine.cpu_threads: the core binding vLLM 0.32 skips for an in-process CPU engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.cpu_threads import parse_cpu_list


def test_cpu_lists_parse_to_sorted_unique_cores():
    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("3,1-2,2") == [1, 2, 3]
    for bad in ("", "a", "1-", "3-1", "0,,1"):
        with pytest.raises(ValueError, match="not a CPU list"):
            parse_cpu_list(bad)


def test_a_bad_bind_is_a_config_error():
    assert EngineConfig(omp_threads_bind="0-1").omp_threads_bind == "0-1"
    with pytest.raises(ValueError, match="not a CPU list: 'cores'"):
        EngineConfig(omp_threads_bind="cores")


PROBE = """
import os, threading
from engine.cpu_threads import bind_cores
done = threading.Event()
early = threading.Thread(target=done.wait); early.start()  # alive until the end
print(bind_cores({spec!r}))
later = []
t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join()
tids = [int(x) for x in os.listdir('/proc/self/task')]
print(sorted({{tuple(sorted(os.sched_getaffinity(t))) for t in tids}}), later[0])
done.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind to one")
def test_binding_moves_every_thread_and_those_started_later():
    core = sorted(os.sched_getaffinity(0))[-1]
    out = subprocess.run([sys.executable, "-c", PROBE.format(spec=str(core))], capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    lines = out.stdout.strip().splitlines()
    assert lines[0] == f"[{core}]"
    assert lines[1] == f"[({core},)] [{core}]"


def test_nobind_and_auto_change_nothing():
    from engine.cpu_threads import bind_cores

    before = os.sched_getaffinity(0)
    assert bind_cores("nobind") is None and bind_cores("auto") is None and bind_cores("") is None
    assert os.sched_getaffinity(0) == before
