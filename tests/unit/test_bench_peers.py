"""``baton bench peers``' workload generators, ceiling and metrics, and how a stack's processes
are started (no engines: the live benchmark runs outside CI)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import msgspec
import pytest

from bench.peers import (
    PeersOptions,
    build_workloads,
    median_steps,
    median_table,
    ratios_vs_best_smg,
    run_order,
    step_table,
)
from bench.peers_client import PeerRecord, fanout_stats, reason_kind, step_stats, summarise
from bench.peers_stacks import PeersError, Stack, StackSpec
from bench.peers_workloads import (
    DEFAULT_TRACE,
    TRACE_CUE,
    AgentFleetOptions,
    PeerRequest,
    PrivatePrefixOptions,
    TraceSliceOptions,
    agent_fleet_workload,
    ceiling_hit_ratio,
    mooncake_slice_workload,
    private_prefix_workload,
    system_prompt,
    trace_block_text,
    trace_slice_workload,
)
from simulator.trace import TraceError, TraceRequest, load_trace


def words(text: str) -> list[int]:
    """A whitespace 'tokenizer': one id per word (the word's position in first-seen order would
    do as well; its hash is enough and stable within a process)."""
    return [hash(w) for w in text.split()]


def test_private_prefix_is_deterministic_and_shaped():
    options = PrivatePrefixOptions(num_agents=3, num_steps=4, prefix_words=200, step_words=20)
    a, b = private_prefix_workload(options), private_prefix_workload(options)
    assert [r.prompt for r in a.requests()] == [r.prompt for r in b.requests()]
    other = private_prefix_workload(PrivatePrefixOptions(num_agents=3, num_steps=4, prefix_words=200,
                                                         step_words=20, seed=1))
    assert [r.prompt for r in other.requests()] != [r.prompt for r in a.requests()]
    requests = a.requests()
    assert len(requests) == 12 and all(r.release_s == 0.0 for r in requests)
    for agent in range(3):
        steps = sorted((r for r in requests if r.agent == agent), key=lambda r: r.step)
        # Each step's prompt extends the previous step's context (its prompt less the cue).
        for earlier, later in zip(steps, steps[1:]):
            context = earlier.prompt.removesuffix("\nNext action:")
            assert later.prompt.startswith(context)
            assert len(later.prompt.split()) - len(earlier.prompt.split()) == 3 + 20  # "Step N observation:" and its words
    first_words = {r.prompt.split()[:10].__str__() for r in requests if r.step == 0}
    assert len(first_words) == 3  # private: no agent shares another's prefix


def test_agent_fleet_shares_the_trunk_and_fans_out():
    options = AgentFleetOptions(num_agents=3, num_steps=4, fanout_step=2, fanout_width=3,
                                system_words=100, think_s_min=0.5, think_s_max=1.5,
                                arrival_gap_s=2.0)
    workload = agent_fleet_workload(options)
    requests = workload.requests()
    assert len(requests) == 3 * (3 + 3)
    trunk = system_prompt(options)
    assert '"name": "search_code"' in trunk
    assert all(r.prompt.startswith(trunk) for r in requests)
    siblings = [r for r in requests if r.fanout_index >= 0]
    assert sorted((r.agent, r.fanout_index) for r in siblings) == [
        (a, k) for a in range(3) for k in range(3)]
    for agent in range(3):
        group = [r for r in siblings if r.agent == agent]
        assert len({r.release_s for r in group}) == 1 and len({r.prompt for r in group}) == 3
        script = workload.agents[agent]
        assert script.start_s == 2.0 * agent
        assert script.steps[0].think_s == 0.0
        assert all(0.5 <= s.think_s <= 1.5 for s in script.steps[1:])
        releases = [s.requests[0].release_s for s in script.steps]
        assert releases == sorted(releases) and releases[0] == 2.0 * agent
    assert [r.prompt for r in agent_fleet_workload(options).requests()] == [r.prompt for r in requests]


def req(agent: int, step: int, prompt: str, release_s: float = 0.0, fanout: int = -1) -> PeerRequest:
    return PeerRequest(f"a{agent}s{step}f{fanout}", agent, step, prompt, 8, fanout, release_s)


def test_ceiling_counts_whole_blocks_and_keeps_the_last_token():
    a = " ".join(f"w{i}" for i in range(10))
    requests = [
        req(0, 0, a),                          # cold: 10 tokens, 0 reusable
        req(0, 1, a + " x1 x2"),               # 10 shared -> 8 in blocks of 4
        req(1, 0, a, release_s=1.0),           # whole prompt shared: at most 9 -> 8
        req(2, 0, "w0 w1 w2 other", release_s=0.0),  # 3 shared with agent 0: under a block
        req(3, 1, a + " y", release_s=2.0, fanout=0),
        req(3, 1, a + " z", release_s=2.0, fanout=1),  # its sibling computed the same 10
    ]
    ceiling = ceiling_hit_ratio(requests, words, block_tokens=4)
    assert ceiling.prompt_tokens == 10 + 12 + 10 + 4 + 11 + 11
    assert ceiling.reusable_tokens == 0 + 8 + 8 + 0 + 8 + 8
    assert ceiling.hit_ratio == pytest.approx(32 / 58)
    assert ceiling_hit_ratio(requests, words, block_tokens=1).reusable_tokens == \
        0 + 10 + 9 + 3 + 10 + 10


def test_ceiling_of_the_private_prefix_workload_is_its_agents_own_history():
    options = PrivatePrefixOptions(num_agents=2, num_steps=3, prefix_words=50, step_words=10)
    ceiling = ceiling_hit_ratio(private_prefix_workload(options).requests(), words, block_tokens=1)
    # Prompt of step s: "Agent N notebook." (3) + 50 + s+1 x ("Step k observation:" 3 + 10) + cue 2
    lengths = [3 + 50 + 13 * (s + 1) + 2 for s in range(3)]
    reusable = [0] + [3 + 50 + 13 * s for s in range(1, 3)]
    assert ceiling.prompt_tokens == 2 * sum(lengths)
    # ... and agent 1's first step shares the word "Agent" with agent 0's prompts.
    assert ceiling.reusable_tokens == 2 * sum(reusable) + 1


def test_trace_blocks_are_seeded_by_their_hash_id():
    block = trace_block_text(0, 7, 64)
    assert trace_block_text(0, 7, 64) == block and len(block.split(" ")) == 64
    assert trace_block_text(0, 8, 64) != block
    assert trace_block_text(1, 7, 64) != block  # --seed changes every text
    assert block.startswith(trace_block_text(0, 7, 10) + " ")  # a partial block is its prefix


# Four requests in the file's order, not arrival order; ids 1 and 2 start r0, r1 and (id 1) r2.
HAND_TRACE = [
    TraceRequest(0.0, 1_024, 5, (1, 2)),              # r0: two whole blocks
    TraceRequest(500.0, 1_792, 5, (1, 2, 3, 4)),      # r1: r0's blocks, a third, half a fourth
    TraceRequest(250.0, 600, 5, (1, 5)),              # r2: r0's first block, then 88 tokens
    TraceRequest(1_000.0, 100, 5, (9,)),              # r3: 100 tokens of its own
]
HAND_OPTIONS = TraceSliceOptions(num_requests=4, block_words=8, time_scale=2.0, max_tokens=4)


def test_trace_slice_prompts_share_text_exactly_where_the_trace_shares_blocks():
    workload = trace_slice_workload(HAND_TRACE, HAND_OPTIONS)
    requests = workload.requests()
    assert workload.name == "mooncake_slice"
    assert [r.request_id for r in requests] == ["mc-r0", "mc-r1", "mc-r2", "mc-r3"]
    assert [r.agent for r in requests] == [0, 1, 2, 3] and all(r.step == 0 for r in requests)
    # Arrival order r0, r2, r1, r3 at the trace's times x2, each its own one-step agent.
    assert [r.release_s for r in requests] == [0.0, 0.5, 1.0, 2.0]
    assert [a.start_s for a in workload.agents] == [0.0, 0.5, 1.0, 2.0]
    assert all(len(a.steps) == 1 and a.steps[0].think_s == 0.0 for a in workload.agents)
    assert all(r.max_tokens == 4 for r in requests)
    r0, r2, r1, r3 = (r.prompt.removesuffix(TRACE_CUE) for r in requests)
    assert all(r.prompt.endswith(TRACE_CUE) for r in requests)
    b = {h: trace_block_text(0, h, 8) for h in (1, 2, 3, 4, 5, 9)}
    # Whole blocks are 8 words; a last block of t tokens is ceil(t * 8 / 512) words.
    assert r0 == f"{b[1]} {b[2]}"
    assert r1 == f"{b[1]} {b[2]} {b[3]} {trace_block_text(0, 4, 4)}"  # 256 tokens: 4 words
    assert r2 == f"{b[1]} {trace_block_text(0, 5, 2)}"                # 88 tokens: 2 words
    assert r3 == trace_block_text(0, 9, 2)                              # 100 tokens: 2 words
    assert len({b[h] for h in b}) == len(b)


def test_the_ceiling_of_a_hand_made_trace_is_its_shared_blocks():
    requests = trace_slice_workload(HAND_TRACE, HAND_OPTIONS).requests()
    # Whitespace tokens: words plus the cue's "Answer:": 17, 11, 29, 3. In release order r0
    # reuses nothing; r2 block 1 of r0 (8 words, two blocks of 4); r1 blocks 1-2 of r0 (16); r3
    # nothing (its 2 words are under a block).
    ceiling = ceiling_hit_ratio(requests, words, block_tokens=4)
    assert ceiling.prompt_tokens == 17 + 11 + 29 + 3
    assert ceiling.reusable_tokens == 0 + 8 + 16 + 0
    assert ceiling.hit_ratio == pytest.approx(24 / 60)


def test_trace_slice_takes_consecutive_requests_and_cuts_prompts_to_the_window():
    options = msgspec.structs.replace(HAND_OPTIONS, start=1, num_requests=2,
                                      max_model_len=20 + 4 + 16)  # room for 20 words
    requests = trace_slice_workload(HAND_TRACE, options).requests()
    assert [r.request_id for r in requests] == ["mc-r1", "mc-r2"]
    assert [r.release_s for r in requests] == [0.0, 0.5]  # counted from the slice's first
    assert [len(r.prompt.removesuffix(TRACE_CUE).split(" ")) for r in requests] == [10, 20]
    # r1's 28 words cut to 20: blocks 1 and 2 and the first 4 words of block 3.
    assert requests[1].prompt.removesuffix(TRACE_CUE) == " ".join(
        [trace_block_text(0, 1, 8), trace_block_text(0, 2, 8), trace_block_text(0, 3, 4)])
    with pytest.raises(TraceError, match="holds 4 requests"):
        trace_slice_workload(HAND_TRACE, msgspec.structs.replace(HAND_OPTIONS, start=1))
    with pytest.raises(TraceError, match="at least 1"):
        trace_slice_workload(HAND_TRACE, msgspec.structs.replace(HAND_OPTIONS, num_requests=0))
    with pytest.raises(TraceError, match="no room"):
        trace_slice_workload(HAND_TRACE, msgspec.structs.replace(HAND_OPTIONS, max_model_len=20))


def test_the_default_slice_is_the_shared_traces_first_requests_at_a_twelfth_of_its_rate():
    trace = load_trace(DEFAULT_TRACE)
    workload = build_workloads(PeersOptions(workloads=("mooncake_slice",)))["mooncake_slice"]
    requests = workload.requests()
    assert len(requests) == 16
    assert [r.release_s for r in requests] == [round(t.timestamp / 1000 * 12, 6) for t in trace[:16]]
    assert requests[-1].release_s == pytest.approx(41.244)
    # 40,160 tokens: 78 whole blocks and 224 tokens, 78 x 64 + 28 words.
    assert len(requests[0].prompt.removesuffix(TRACE_CUE).split(" ")) == 78 * 64 + 28
    assert [r.prompt for r in requests] == [r.prompt for r in mooncake_slice_workload(
        TraceSliceOptions()).requests()]
    # The trace's first 16 requests share no block: nothing to reuse but chance words.
    assert ceiling_hit_ratio(requests, words, block_tokens=128).reusable_tokens == 0


def test_the_ceiling_counts_blocks_of_the_engines_as_they_run():
    """The hit-ratio ceiling's grain is the engines' KV block (both stacks get the same), not
    vLLM-CPU's 128: at 128 a cache that reuses every whole 32-token block would pass it."""
    from engine.config import EngineConfig

    assert PeersOptions().block_tokens == EngineConfig().kv_block_tokens == 32
    first = req(0, 0, " ".join(f"w{i}" for i in range(100)))
    second = req(0, 1, first.prompt + " tail", release_s=1.0)
    assert ceiling_hit_ratio([first, second], words, PeersOptions().block_tokens).reusable_tokens == 96
    assert ceiling_hit_ratio([first, second], words, 128).reusable_tokens == 0


def test_peers_races_the_trace_slice_only_when_asked():
    assert PeersOptions().workloads == ("private_prefix", "agent_fleet")
    assert set(build_workloads(PeersOptions())) == {"private_prefix", "agent_fleet"}
    with pytest.raises(PeersError, match="mooncake_slice"):
        build_workloads(PeersOptions(workloads=("mooncake",)))


def record(request_id: str, sent: float, deltas: list[float], prompt: int, cached: int,
           agent: int = 0, step: int = 0, fanout: int = -1, **kw) -> PeerRecord:
    return PeerRecord(request_id, agent, step, fanout, sent, deltas, prompt, cached, len(deltas), **kw)


def test_summarise_uses_vllm_names_and_the_ceiling():
    records = [
        record("a", 0.0, [0.5, 0.6, 0.7], 100, 0),
        record("b", 1.0, [1.2, 1.3, 1.4], 100, 80, step=1, fanout=0),
        record("c", 1.0, [1.4, 1.5, 1.6], 100, 80, step=1, fanout=1),
        record("d", 2.0, [], 100, 0, error="HTTP 500: boom"),
    ]
    report = summarise(records, duration_s=2.0, ceiling_hit_ratio=0.8)
    assert report["completed"] == 3 and report["failed"] == 1
    assert report["mean_ttft_ms"] == pytest.approx((500 + 200 + 400) / 3)
    assert report["mean_tpot_ms"] == pytest.approx(100)
    assert report["p90_ttft_ms"] > report["median_ttft_ms"]
    assert report["output_throughput"] == pytest.approx(9 / 2.0)
    assert report["hit_ratio"] == pytest.approx(160 / 300)
    assert report["hit_ratio_vs_ceiling"] == pytest.approx(160 / 300 / 0.8)
    assert report["reports_cached_tokens"] is True
    assert report["fanout"] == {"num_siblings": 2, "mean_ttft_ms": pytest.approx(300),
                                "p90_ttft_ms": pytest.approx(380), "max_ttft_ms": pytest.approx(400),
                                "mean_spread_ms": pytest.approx(200)}
    assert report["first_error"] == "HTTP 500: boom"


def test_a_stack_without_cached_tokens_has_no_ratio_vs_ceiling():
    report = summarise([record("a", 0.0, [0.1, 0.2], 10, -1)], 1.0, 0.5)
    assert report["reports_cached_tokens"] is False and report["hit_ratio_vs_ceiling"] is None
    assert fanout_stats([]) is None


def test_each_step_reports_its_ttft_how_far_apart_it_was_sent_and_its_priced_queue():
    placed = {"queue_ms": 300.0}
    records = [
        record("a0", 0.0, [2.0, 2.1], 100, 0, agent=0, step=0, placement={"queue_ms": 0.0}),
        record("a1", 1.0, [2.5, 2.6], 100, 80, agent=1, step=0, placement={"queue_ms": 1000.0}),
        record("a0-f0", 5.0, [5.4], 100, 80, agent=0, step=1, fanout=0, placement=placed),
        record("a0-f1", 5.0, [5.8], 100, 80, agent=0, step=1, fanout=1, placement=placed),
        record("a1-f0", 5.5, [6.3], 100, 80, agent=1, step=1, fanout=0, placement=placed),
        record("a1-s2", 9.0, [9.5], 100, 80, agent=1, step=2),  # no placement: an SMG stack's
    ]
    by_step = summarise(records, 10.0, 1.0)["by_step"]
    assert by_step == step_stats(records)
    assert list(by_step) == ["step 0", "step 1 (fan-out)", "step 2"]
    assert by_step["step 0"] == {"count": 2, "mean_ttft_ms": pytest.approx(1750.0),
                                 "arrival_spread_ms": pytest.approx(1000.0),
                                 "mean_queue_ms": pytest.approx(500.0)}
    assert by_step["step 1 (fan-out)"]["mean_ttft_ms"] == pytest.approx((400 + 800 + 800) / 3)
    assert by_step["step 1 (fan-out)"]["arrival_spread_ms"] == pytest.approx(500.0)
    assert by_step["step 2"]["mean_queue_ms"] is None
    runs = [{"by_step": by_step}, {"by_step": {**by_step, "step 0": {**by_step["step 0"],
                                                                     "mean_ttft_ms": 2750.0}}},
            {"by_step": {}}]
    medians = median_steps(runs)
    assert medians["step 0"] == {"mean_ttft_ms": pytest.approx(2250.0),
                                 "arrival_spread_ms": pytest.approx(1000.0),
                                 "mean_queue_ms": pytest.approx(500.0)}
    assert medians["step 2"]["mean_queue_ms"] is None
    table = step_table({"baton": medians, "smg": {"step 0": {**medians["step 0"], "mean_queue_ms": None}}})
    assert table[2] == "| stack | step 0 | step 1 (fan-out) | step 2 |"
    assert table[4] == ("| baton | 2,250 (sent over 1.0 s, queue 500) | 667 (sent over 0.5 s, "
                        "queue 300) | 500 (sent over 0.0 s) |")
    assert table[5] == "| smg | 2,250 (sent over 1.0 s) | n/a | n/a |"
    assert step_table({"smg": {}}) == []


def test_reason_kind_drops_the_numbers():
    assert reason_kind("colocated: no prefill pool; p0 T=12.5ms; d1 running 3") == \
        "colocated: no prefill pool"
    assert reason_kind("colocated: uncached suffix 17 tokens < short_prefill_tokens 256; x") == \
        "colocated: uncached suffix N tokens < short_prefill_tokens N"


def test_medians_ratios_and_interleaving():
    assert run_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert run_order(["a", "b", "c"], 4) == ["b", "c", "a"]

    def rep(ttft: float, thr: float) -> dict:
        base = {k: 1.0 for k in ("p90_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "hit_ratio")}
        return {**base, "mean_ttft_ms": ttft, "output_throughput": thr}

    medians = {"smg-cache_aware": median_table([rep(100, 10), rep(300, 10), rep(200, 10)]),
               "smg-round_robin": median_table([rep(250, 8)]),
               "baton-1p1d": median_table([rep(100, 20), rep(150, 20), rep(900, 20)])}
    assert medians["smg-cache_aware"]["mean_ttft_ms"] == {"median": 200, "min": 100, "max": 300}
    assert medians["baton-1p1d"]["hit_ratio_vs_ceiling"]["median"] is None
    result = ratios_vs_best_smg(medians)
    assert result["best_smg"] == "smg-cache_aware"
    assert result["ratios"]["baton-1p1d"]["mean_ttft_ms"] == pytest.approx(0.75)
    assert result["ratios"]["baton-1p1d"]["output_throughput"] == pytest.approx(2.0)


def test_each_vllm_server_runs_one_openmp_thread_as_each_baton_engine_does():
    """A one-process vLLM-CPU server ignores VLLM_CPU_OMP_THREADS_BIND and would start one
    OpenMP thread per core; Ray starts Baton's engines with OMP_NUM_THREADS=1."""
    from bench.peers_stacks import server_cores, vllm_server_env
    from engine.config import EngineConfig

    env = vllm_server_env(EngineConfig(), "1")
    assert env["OMP_NUM_THREADS"] == "1" and vllm_server_env(EngineConfig(), "0-1")["OMP_NUM_THREADS"] == "1"
    assert server_cores("1") == [1] and server_cores("0-1") == [0, 1] and server_cores("nobind") is None
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_the_live_cost_model_error_is_read_from_the_fronts_metrics():
    from bench.peers import parse_cost_model_error

    text = ('# HELP baton_cost_model_error_pct x\n# TYPE baton_cost_model_error_pct gauge\n'
            'baton_cost_model_error_pct{model="prefill",stat="median"} 6.5\n'
            'baton_cost_model_error_pct{model="prefill",stat="p90"} 19.25\n'
            '# TYPE baton_request_success counter\nbaton_request_success_total{finished_reason="stop"} 3.0\n')
    assert parse_cost_model_error(text) == {"prefill": {"median": 6.5, "p90": 19.25}}
    assert parse_cost_model_error("") == {}


@pytest.mark.parametrize(("name", "cmdline", "role"), [
    ("ray::DecodeWorker", "ray::DecodeWorker.generate", "engine"),
    ("python", "VLLM::EngineCore", "engine"),
    ("python", "/v/bin/python -m vllm.entrypoints.openai.api_server --port 1", "frontend"),
    ("python", "/v/bin/python -m cli.main serve --prefill 0", "frontend"),
    ("smg", "/v/bin/smg launch --policy round_robin", "frontend"),
    ("ray::Conductor", "ray::Conductor", "conductor"),
    ("ray::ClusterConductor", "ray::ClusterConductor.place", "conductor"),
    ("ray::KVStoreNode", "ray::KVStoreNode", "store"),
    ("gcs_server", "/v/lib/ray/core/src/ray/gcs/gcs_server --port 1", "ray"),
    ("raylet", "/v/raylet --node", "ray"),
    ("redis-server", "redis-server 127.0.0.1:6379", "redis"),
    ("bash", "bash -c true", "other"),
])
def test_processes_get_their_role_from_their_command_line(name, cmdline, role):
    from bench.peers_cpu import role_of

    assert role_of(name, cmdline) == role


def test_cpu_by_role_counts_a_busy_child_and_not_an_idle_one():
    import subprocess
    import sys
    import time

    from bench.peers_cpu import by_role, shares, snapshot

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = snapshot([root.pid])
        child = subprocess.Popen([sys.executable, "-c", busy + "time.sleep(30)"])  # not in the tree
        try:
            time.sleep(1.5)
            after = snapshot([root.pid, child.pid])
        finally:
            child.kill()
    finally:
        root.kill()
    spent = by_role(before, after)
    assert set(before) == {root.pid}
    assert 0.55 <= spent["other"] <= 1.0  # the busy child's 0.6 s (born after the first snapshot)
    assert sum(v for k, v in spent.items() if k != "other") == 0.0
    assert shares({"other": 1.0}, 2.0, 2) == {"other": 0.25}


def test_model_threads_are_each_engine_processes_busiest_thread():
    import subprocess
    import sys
    import time

    from bench.peers_cpu import by_role, engine_threads, model_thread_seconds, snapshot

    # an "engine" (its command line names EngineCore): the main thread spins 0.8 s, a side
    # thread 0.3 s (and stays alive), both after the first snapshot
    code = ("import threading, time, sys\n"
            "def spin(s, then=0.0):\n    t = time.thread_time()\n"
            "    while time.thread_time() - t < s: pass\n    time.sleep(then)\n"
            "sys.stdin.readline()\n"
            "threading.Thread(target=spin, args=(0.3, 30), daemon=True).start()\n"
            "spin(0.8); time.sleep(30)\n")
    engine = subprocess.Popen([sys.executable, "-c", code, "EngineCore"], stdin=subprocess.PIPE)
    try:
        time.sleep(0.5)
        before, threads_before = snapshot([engine.pid]), engine_threads([engine.pid])
        engine.stdin.write(b"go\n")
        engine.stdin.flush()
        time.sleep(2.0)
        after, threads_after = snapshot([engine.pid]), engine_threads([engine.pid])
    finally:
        engine.kill()
    model = model_thread_seconds(threads_before, threads_after)
    assert 0.75 <= model <= 1.0  # the main thread's 0.8 s, not the side thread's too
    assert 1.05 <= by_role(before, after)["engine"] <= 1.4  # both threads
    assert engine_threads([]) == {}


def test_smg_stacks_are_tuned_over_router_and_server_settings_and_baton_is_not():
    from bench.peers_stacks import (
        SMG_BALANCED,
        SMG_TUNING,
        StackSpec,
        smg_argv,
        tuning_variants,
        vllm_server_argv,
    )
    from pathlib import Path

    from engine.config import EngineConfig
    from engine.models import PreparedModel

    cache_aware = StackSpec("smg-cache_aware", "smg", smg_policy="cache_aware")
    variants = tuning_variants(cache_aware)
    assert [(v.name, v.router_args, v.server_args) for v in variants] == [
        ("smg-cache_aware", SMG_TUNING, ()),
        ("smg-cache_aware", SMG_TUNING, ("--max-num-batched-tokens", "512")),
        ("smg-cache_aware", SMG_BALANCED, ()),
        ("smg-cache_aware", SMG_BALANCED, ("--max-num-batched-tokens", "512")),
    ]
    assert len({v.variant for v in variants}) == 4
    round_robin = tuning_variants(StackSpec("smg-round_robin", "smg", smg_policy="round_robin"))
    assert [(v.router_args, v.server_args) for v in round_robin] == [
        ((), ()), ((), ("--max-num-batched-tokens", "512"))]
    baton = StackSpec("baton-0p2d", "baton", num_prefill=0, num_decode=2)
    assert tuning_variants(baton) == [baton]  # races as `baton serve` ships

    # the settings reach the command lines; untuned, cache_aware keeps the guide's
    urls = ["http://127.0.0.1:1"]
    assert smg_argv("cache_aware", 9, urls)[-len(SMG_TUNING):] == list(SMG_TUNING)
    assert smg_argv("cache_aware", 9, urls, SMG_BALANCED)[-len(SMG_BALANCED):] == list(SMG_BALANCED)
    assert smg_argv("round_robin", 9, urls)[-4:] == ["--policy", "round_robin", "--log-level",
                                                      "warn"]
    model = PreparedModel(name="m", path=Path("/m"), num_layers=1, num_kv_heads=1, head_dim=8,
                          max_model_len=256)
    argv = vllm_server_argv(model, EngineConfig(), 9, variants[1].server_args)
    assert argv[-2:] == ["--max-num-batched-tokens", "512"]
    assert "--max-num-batched-tokens" not in vllm_server_argv(model, EngineConfig(), 9)


def test_tuning_reseeds_every_workload_and_picks_the_least_geometric_mean_ttft():
    from bench.peers import TUNE_SEED_OFFSET, best_variant, tuning_options, tuning_score

    options = PeersOptions()
    tuned = tuning_options(options)
    assert (tuned.private.seed, tuned.fleet.seed, tuned.trace.seed) == (TUNE_SEED_OFFSET,) * 3
    assert msgspec.structs.replace(tuned.fleet, seed=0) == options.fleet
    race, tuning = build_workloads(options), build_workloads(tuned)
    race_prompts = {r.prompt for w in race.values() for r in w.requests()}
    assert not race_prompts & {r.prompt for w in tuning.values() for r in w.requests()}

    assert tuning_score([{"mean_ttft_ms": 100.0, "failed": 0},
                         {"mean_ttft_ms": 400.0, "failed": 0}]) == pytest.approx(200.0)
    assert tuning_score([{"mean_ttft_ms": 100.0, "failed": 1}]) == float("inf")
    assert tuning_score([]) == float("inf")
    assert best_variant({"a": 300.0, "b": 200.0, "c": 200.0}) == "b"


def test_with_a_seed_per_run_each_run_draws_its_own_workloads_and_every_stack_the_same():
    from bench.peers import aggregate, markdown, run_options
    from bench.peers_workloads import Ceiling

    fixed = PeersOptions(seed_per_run=False)
    assert run_options(fixed, 2) is fixed
    varied = PeersOptions(seed_per_run=True, fleet=AgentFleetOptions(seed=9))
    assert run_options(varied, 0) == varied
    second = run_options(varied, 1)
    assert (second.fleet.seed, second.private.seed, second.trace.seed) == (10, 1, 1)
    assert msgspec.structs.replace(second.fleet, seed=9) == varied.fleet
    prompts = [{r.prompt for r in build_workloads(run_options(varied, k))["agent_fleet"].requests()}
               for k in range(2)]
    assert prompts[0] != prompts[1]
    assert prompts[1] == {r.prompt for r in build_workloads(run_options(varied, 1))["agent_fleet"].requests()}

    options = PeersOptions(runs=3, seed_per_run=True, stacks=("smg-round_robin",),
                           workloads=("agent_fleet",), fleet=AgentFleetOptions(seed=9))
    draws = [{"agent_fleet": Ceiling(tokens, reusable)}
             for tokens, reusable in ((100, 80), (300, 270), (200, 170))]
    base = {k: 1.0 for k in ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "mean_e2el_ms",
                             "output_throughput", "hit_ratio")}
    runs = [{"run": k, "stack": "smg-round_robin", "workload": "agent_fleet", **base}
            for k in range(3)]
    report = aggregate(runs, options, draws)
    assert report["summary"]["agent_fleet"]["ceiling_hit_ratio"] == pytest.approx(0.85)
    assert report["summary"]["agent_fleet"]["ceiling_prompt_tokens"] == 200
    assert markdown(report).startswith("### agent_fleet (median ceiling hit ratio 0.850; medians "
                                       "of 3 run(s), [min-max], run k drawn from seed 9 + k;")


def test_each_run_pairs_baton_with_the_better_smg_of_the_same_run():
    from bench.peers import aggregate, markdown, paired_ratios
    from bench.peers_workloads import Ceiling

    def rep(stack: str, run: int, ttft: float, thr: float) -> dict:
        base = {k: 1.0 for k in ("mean_tpot_ms", "mean_e2el_ms", "hit_ratio")}
        return {"run": run, "stack": stack, "workload": "agent_fleet", **base,
                "mean_ttft_ms": ttft, "p90_ttft_ms": 2 * ttft, "output_throughput": thr}

    runs = [rep("smg-round_robin", 0, 1000, 10), rep("baton-0p2d", 0, 800, 11),
            rep("smg-round_robin", 1, 1625, 12), rep("baton-0p2d", 1, 1300, 9),
            rep("smg-round_robin", 2, 2000, 10),  # baton-0p2d failed in run 2: no pair
            rep("smg-cache_aware", 0, 3000, 5)]
    assert paired_ratios(runs, "baton-0p2d", "smg-round_robin") == {
        "mean_ttft_ms": [0.8, 0.8], "p90_ttft_ms": [0.8, 0.8], "output_throughput": [1.1, 0.75]}
    options = PeersOptions(runs=3, stacks=("smg-round_robin", "baton-0p2d", "smg-cache_aware"),
                           workloads=("agent_fleet",))
    report = aggregate(runs, options, [{"agent_fleet": Ceiling(100, 80)}])
    summary = report["summary"]["agent_fleet"]
    assert summary["best_smg"] == "smg-round_robin"
    assert list(summary["paired_ratios"]) == ["baton-0p2d"]
    assert ("baton-0p2d against smg-round_robin run by run (each run's pair): TTFT mean 0.80, "
            "0.80x; p90 0.80, 0.80x; throughput 1.10, 0.75x.") in markdown(report).splitlines()


def test_a_race_may_reuse_the_settings_an_earlier_runs_tuning_chose(tmp_path):
    import json

    from bench.peers import markdown, reuse_tuning
    from bench.peers_stacks import DEFAULT_STACKS

    tuning = {"seed_offset": 1000,
              "smg-cache_aware": {"chosen": "early balance, 512 batched tokens",
                                  "scores": {"guide's thresholds, vLLM defaults": 7000.0,
                                             "early balance, 512 batched tokens": 5000.0}},
              "smg-round_robin": {"chosen": "as shipped, vLLM defaults",
                                  "scores": {"as shipped, vLLM defaults": 5500.0}}}
    earlier = tmp_path / "peers.json"
    earlier.write_text(json.dumps({"tuning": tuning}))
    specs, reused = reuse_tuning(DEFAULT_STACKS, earlier)
    by_name = {s.name: s for s in specs}
    assert by_name["smg-cache_aware"].variant == "early balance, 512 batched tokens"
    assert by_name["smg-cache_aware"].server_args == ("--max-num-batched-tokens", "512")
    assert by_name["smg-round_robin"].variant == "as shipped, vLLM defaults"
    assert by_name["baton-0p2d"] == next(s for s in DEFAULT_STACKS if s.name == "baton-0p2d")
    assert reused["reused_from"] == str(earlier)
    text = markdown({"options": {"runs": 1}, "summary": {}, "tuning": reused})
    assert (f"SMG tuned by an earlier run ({earlier}; its tuning set: its workloads at its seed "
            "+ 1000), not in this one, one run per setting" in text)
    assert "| smg-cache_aware | early balance, 512 batched tokens | 5,000 | yes |" in text

    del tuning["smg-round_robin"]
    earlier.write_text(json.dumps({"tuning": tuning}))
    with pytest.raises(PeersError, match="no tuning of smg-round_robin there"):
        reuse_tuning(DEFAULT_STACKS, earlier)
    earlier.write_text("{}")
    with pytest.raises(PeersError, match="not the peers.json of a tuned run"):
        reuse_tuning(DEFAULT_STACKS, earlier)


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


def test_stop_signals_every_process_before_it_waits_for_any(tmp_path):
    """Two processes that ignore SIGINT: both get it at once, then SIGKILL after one grace
    period for the two (not one grace period each, in turn)."""
    spec = StackSpec("smg-round_robin", "smg", smg_policy="round_robin")
    stack = Stack(spec, model=None, log_dir=tmp_path)
    stack.STOP_STEPS = ((signal.SIGINT, 2.0), (signal.SIGKILL, 5.0))
    ignore = ("import signal, sys, time\n"
              "def got(*_):\n"
              "    open(sys.argv[1], 'w').write(repr(time.monotonic()))\n"
              "signal.signal(signal.SIGINT, got)\n"
              "open(sys.argv[1] + '.up', 'w').close()\n"
              "time.sleep(60)\n")
    marks = [tmp_path / "a", tmp_path / "b"]
    for mark in marks:
        stack._spawn(mark.name, [sys.executable, "-c", ignore, str(mark)])
    deadline = time.monotonic() + 20
    while not all(Path(f"{m}.up").exists() for m in marks) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = [proc for _, proc in stack.procs]
    stack.stop()
    got = sorted(float(m.read_text()) for m in marks)
    assert got[1] - got[0] < 1.0  # the second SIGINT did not wait for the first's grace period
    assert [proc.returncode for proc in procs] == [-signal.SIGKILL, -signal.SIGKILL]
    assert stack.procs == []


def test_the_decode_models_per_request_error_reaches_the_metrics_bench_peers_reads():
    from prometheus_client import REGISTRY, generate_latest

    from bench.peers import parse_cost_model_error
    from gateway.metrics import _set_cost_model
    from protos.wire import CostModelStatus, PredictionError

    _set_cost_model(CostModelStatus(True, PredictionError(6.5, 19.25, 40),
                                    PredictionError(8.0, 31.0, 200), "", 0.0, None,
                                    PredictionError(3.5, 9.25, 60)))
    errors = parse_cost_model_error(generate_latest(REGISTRY).decode())
    assert (errors["decode"], errors["decode_per_request"]) == (
        {"median": 8.0, "p90": 31.0}, {"median": 3.5, "p90": 9.25})


def test_model_threads_median_and_the_rest_of_the_stacks_cpu():
    from bench.peers import median_model_threads

    runs = [{"cpu_s_model_threads": m, "cpu_s_by_role": {"engine": e, "conductor": c}}
            for m, e, c in ((60.0, 62.0, 1.0), (64.0, 66.5, 0.5), (58.0, 61.0, 2.0))]
    assert median_model_threads(runs) == {"model": 60.0, "rest": 3.0}  # rests 3.0, 3.0, 5.0
    assert median_model_threads([{"cpu_s_by_role": {"engine": 1.0}}]) is None
