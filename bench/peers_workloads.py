"""Seeded agent workloads for ``baton bench peers``, and the hit-ratio ceiling they allow.

Every prompt is deterministic text (a function of the workload's options and seed only) and no
assistant reply is fed back, so every stack under test receives byte-identical requests in the
same dependency order. A workload is a set of agent scripts; an agent sends its steps one after
another (a step waits for the previous one's answers, then its think time); a fan-out step sends
its sibling requests at once.

Three workloads, as issue 16 describes them:

- ``private_prefix_workload``: agents, each with its own ~1,500-token private prefix, every
  step appending ~100 tokens, all agents' steps released together (no think time).
- ``agent_fleet_workload``: one shared system prompt with tool definitions, each agent its own
  task, a tool result appended per step after a seeded think time, and one fan-out step of
  parallel sub-requests that share the agent's whole context.
- ``mooncake_slice_workload``: consecutive requests of a Mooncake-format trace, each its own
  one-step agent started at its (scaled) arrival time, its prompt one seeded text block per
  hash id (see ``trace_slice_workload``).

The ceiling (``ceiling_hit_ratio``) is what an infinite prefix cache shared by every engine
could reuse: for each request the longest token prefix it shares with any request before it
in release order (ties: agent, step, sibling; so a fan-out's later siblings reuse the part of
the context the first one computed), less the last prompt token (an engine always computes it),
floored to whole KV blocks.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from simulator.trace import TRACE_BLOCK_TOKENS, TraceError, TraceRequest, load_trace

WORDS = ["account", "action", "agent", "answer", "array", "batch", "buffer", "build", "cache", "call", "case", "change", "check", "client", "code", "column", "config", "context", "copy", "count", "cursor", "data", "date", "debug", "delta", "design", "detail", "device", "diff", "disk", "document", "draft", "edge", "entry", "error", "event", "field", "file", "filter", "format", "frame", "function", "graph", "group", "handle", "header", "history", "index", "input", "issue", "item", "job", "key", "label", "layer", "length", "limit", "line", "list", "load", "local", "log", "loop", "match", "memory", "merge", "message", "method", "model", "module", "name", "network", "node", "number", "object", "offset", "option", "order", "output", "owner", "packet", "page", "parse", "patch", "path", "pattern", "plan", "point", "policy", "pool", "port", "query", "queue", "range", "rate", "record", "region", "report", "request", "result", "retry", "route", "row", "rule", "sample", "schema", "scope", "score", "search", "section", "server", "session", "shape", "signal", "size", "slice", "source", "space", "stage", "state", "status", "step", "store", "stream", "string", "table", "target", "task", "test", "thread", "time", "token", "total", "trace", "tree", "type", "update", "user", "value", "version", "view", "window", "worker", "zone"]
"""Common English words: about one SmolLM2 token each after a space."""

TOOLS = (
    ("search_code", "Search the repository for a pattern and return matching lines.",
     {"pattern": "string", "path": "string", "max_results": "integer"}),
    ("read_file", "Read a file, optionally a line range.",
     {"path": "string", "start_line": "integer", "end_line": "integer"}),
    ("run_tests", "Run the test suite or one test module and return the failures.",
     {"target": "string", "timeout_s": "number"}),
    ("edit_file", "Replace a span of a file with new text.",
     {"path": "string", "old_text": "string", "new_text": "string"}),
    ("query_logs", "Query the service logs between two times for a message.",
     {"service": "string", "since": "string", "until": "string", "message": "string"}),
    ("open_ticket", "Open a ticket in the issue tracker.",
     {"title": "string", "body": "string", "priority": "string"}),
)


class PeerRequest(msgspec.Struct, frozen=True):
    """One completion request of a workload."""

    request_id: str
    agent: int
    step: int
    prompt: str
    max_tokens: int
    fanout_index: int = -1
    """Sibling number within a fan-out step; -1 outside one."""
    release_s: float = 0.0
    """When the request would be sent if every answer took no time (s from the start)."""


class AgentStep(msgspec.Struct, frozen=True):
    think_s: float
    """Pause after the previous step's answers (or the agent's start) before sending (s)."""
    requests: tuple[PeerRequest, ...]
    """One request, or the siblings of a fan-out step, sent together."""


class AgentScript(msgspec.Struct, frozen=True):
    agent: int
    start_s: float
    """When the agent's first step may go (s from the start of the workload)."""
    steps: tuple[AgentStep, ...]


class Workload(msgspec.Struct, frozen=True):
    name: str
    agents: tuple[AgentScript, ...]
    options: dict

    def requests(self) -> list[PeerRequest]:
        """Every request in release order (ties: agent, step, sibling)."""
        return sorted((r for a in self.agents for s in a.steps for r in s.requests),
                      key=lambda r: (r.release_s, r.agent, r.step, r.fanout_index))


def words_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _seeded(seed: int, *parts: object) -> random.Random:
    # A string seed is hashed with SHA-512: the same text in every process and Python run.
    return random.Random(":".join(["baton-peers", str(seed), *map(str, parts)]))


class PrivatePrefixOptions(msgspec.Struct, frozen=True):
    num_agents: int = 4
    num_steps: int = 4
    prefix_words: int = 1_500
    """Words of each agent's private prefix (~1 token each)."""
    step_words: int = 100
    """Words each step appends."""
    max_tokens: int = 32
    seed: int = 0


def private_prefix_workload(options: PrivatePrefixOptions) -> Workload:
    """Agents with private prefixes whose steps are all released together (no think time)."""
    agents = []
    for agent in range(options.num_agents):
        rng = _seeded(options.seed, "private", agent)
        context = (f"Agent {agent} notebook. " + words_text(rng, options.prefix_words))
        steps = []
        for step in range(options.num_steps):
            context += f"\nStep {step} observation: " + words_text(rng, options.step_words)
            request = PeerRequest(f"pp-a{agent}-s{step}", agent, step, context + "\nNext action:",
                                  options.max_tokens, release_s=0.0)
            steps.append(AgentStep(0.0, (request,)))
        agents.append(AgentScript(agent, 0.0, tuple(steps)))
    return _released(Workload("private_prefix", tuple(agents), msgspec.structs.asdict(options)))


class AgentFleetOptions(msgspec.Struct, frozen=True):
    num_agents: int = 4
    num_steps: int = 4
    """Steps per agent, the fan-out step included."""
    fanout_step: int = 2
    """Which step is the fan-out (0-based); -1: none."""
    fanout_width: int = 3
    system_words: int = 600
    """Words of prose in the shared system prompt, besides the tool definitions."""
    task_words: int = 80
    tool_result_words: int = 120
    subtask_words: int = 40
    think_s_min: float = 0.5
    think_s_max: float = 2.0
    arrival_gap_s: float = 1.0
    """Agent i starts at i times this (s)."""
    max_tokens: int = 32
    seed: int = 0


def system_prompt(options: AgentFleetOptions) -> str:
    """The fleet's shared system prompt: instructions and the tool definitions as JSON."""
    rng = _seeded(options.seed, "system")
    tools = [{"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in params.items()},
                       "required": list(params)}}} for name, description, params in TOOLS]
    return ("You are an engineering agent. Use the tools to finish the task. Answer with one tool "
            "call as JSON.\nGuidelines: " + words_text(rng, options.system_words)
            + "\nTools:\n" + json.dumps(tools, indent=1) + "\n")


def agent_fleet_workload(options: AgentFleetOptions) -> Workload:
    """A fleet sharing one system prompt; tool results after think times; one fan-out step."""
    trunk = system_prompt(options)
    tool_names = [name for name, _, _ in TOOLS]
    agents = []
    for agent in range(options.num_agents):
        rng = _seeded(options.seed, "fleet", agent)
        context = trunk + f"Task of agent {agent}: " + words_text(rng, options.task_words) + "\n"
        steps = []
        for step in range(options.num_steps):
            think_s = 0.0 if step == 0 else round(rng.uniform(options.think_s_min, options.think_s_max), 3)
            if step > 0:
                tool = tool_names[rng.randrange(len(tool_names))]
                context += f"Tool {tool} returned: " + words_text(rng, options.tool_result_words) + "\n"
            if step == options.fanout_step:
                siblings = tuple(
                    PeerRequest(f"fl-a{agent}-s{step}-f{k}", agent, step,
                                context + f"Subtask {k}: " + words_text(rng, options.subtask_words)
                                + "\nCall:", options.max_tokens, fanout_index=k)
                    for k in range(options.fanout_width))
                steps.append(AgentStep(think_s, siblings))
                context += "".join(f"Subtask {k} result: " + words_text(rng, options.subtask_words // 2)
                                   + "\n" for k in range(options.fanout_width))
            else:
                request = PeerRequest(f"fl-a{agent}-s{step}", agent, step, context + "Call:",
                                      options.max_tokens)
                steps.append(AgentStep(think_s, (request,)))
        agents.append(AgentScript(agent, agent * options.arrival_gap_s, tuple(steps)))
    return _released(Workload("agent_fleet", tuple(agents), msgspec.structs.asdict(options)))


DEFAULT_TRACE = str(Path(__file__).resolve().parents[1] / "tests" / "data"
                    / "mooncake_synthetic_trace.jsonl")
"""The shared Mooncake synthetic trace, as the repository ships it."""

TRACE_CUE = "\nAnswer:"
TRACE_CUE_TOKENS_BOUND = 16
"""Tokens kept free for the cue (and a BOS) when a prompt is cut to the window."""


class TraceSliceOptions(msgspec.Struct, frozen=True):
    trace_path: str = DEFAULT_TRACE
    """A Mooncake-format ``.jsonl`` (``simulator.trace``)."""
    start: int = 0
    """Index, in arrival order, of the slice's first request. The synthetic trace reuses blocks
    from far back: 58% of its 32-request slices, the first one too, share no block within
    themselves (ceiling 0); the slice from 3944 has ceiling ~0.52."""
    num_requests: int = 16
    """Consecutive requests in the slice. The default slice's prompts, scaled: mean ~2,820
    tokens, median ~2,630, max ~7,050 (45k prompt tokens). 32 (55k tokens) at x4 left every
    stack at 14-19 s mean TTFT on two cores, queueing more than placing."""
    block_words: int = 64
    """Words (~SmolLM2 tokens) per trace block of ``TRACE_BLOCK_TOKENS`` (512) tokens."""
    time_scale: float = 12.0
    """Arrival times are the trace's, counted from the slice's first request, times this. The
    trace's rate is far beyond two CPU cores even with 8x shorter prompts: the default slice
    arrives over 3.4 s at its own rate, x12 over 41 s (~1,100 prompt tokens/s, the trace's
    bursts left in); its longest prompts still keep every stack's mean TTFT at 8-10 s here."""
    max_model_len: int = 8_192
    """The engines' context window (tokens): longer prompts are cut to fit with the cue and
    ``max_tokens``."""
    max_tokens: int = 32
    """Tokens every request generates (ignore_eos), whatever the trace's output_length."""
    seed: int = 0


def trace_block_text(seed: int, hash_id: int, num_words: int) -> str:
    """Block ``hash_id``'s text: its first ``num_words`` seeded words, so equal ids give the
    same text and a partial block is a prefix of the whole one."""
    return words_text(_seeded(seed, "trace-block", hash_id), num_words)


def trace_prompt(request: TraceRequest, options: TraceSliceOptions) -> str:
    """The request's blocks' texts joined, the last block scaled like the others (at least one
    word), cut to the window, then the cue. Every word is one SmolLM2 token after a space, so
    requests share a token prefix exactly where the trace shares blocks."""
    last_block_tokens = request.input_length - TRACE_BLOCK_TOKENS * (len(request.hash_ids) - 1)
    num_words = [options.block_words] * (len(request.hash_ids) - 1)
    num_words.append(max(1, math.ceil(last_block_tokens * options.block_words / TRACE_BLOCK_TOKENS)))
    text = " ".join(trace_block_text(options.seed, h, n) for h, n in zip(request.hash_ids, num_words))
    max_words = options.max_model_len - options.max_tokens - TRACE_CUE_TOKENS_BOUND
    return " ".join(text.split(" ")[:max_words]) + TRACE_CUE


def trace_slice_workload(trace: Sequence[TraceRequest], options: TraceSliceOptions) -> Workload:
    """Requests ``start`` to ``start + num_requests`` of ``trace`` (in arrival order), each its
    own one-step agent started at its arrival time less the slice's first, times ``time_scale``.

    The trace's 512-token blocks become ``block_words``-word blocks (64: 8x shorter) so the
    prompts fit SmolLM2's 8,192-token window and a slice runs in under a minute on two cores.
    Raises ``TraceError`` when the slice is empty, runs past the trace or leaves no room for a
    prompt.
    """
    if options.num_requests < 1 or options.block_words < 1 or options.time_scale < 0:
        raise TraceError("--trace-requests and --trace-block-words must be at least 1, "
                         "--trace-time-scale at least 0")
    if options.max_model_len - options.max_tokens - TRACE_CUE_TOKENS_BOUND < 1:
        raise TraceError(f"--max-tokens {options.max_tokens} leaves no room for a prompt in a "
                         f"{options.max_model_len}-token window")
    if not 0 <= options.start <= len(trace) - options.num_requests:
        raise TraceError(f"the trace holds {len(trace)} requests: --trace-start plus "
                         f"--trace-requests must be at most that (got {options.start} + "
                         f"{options.num_requests})")
    ordered = sorted(trace, key=lambda r: r.timestamp)
    sliced = ordered[options.start:options.start + options.num_requests]
    origin_ms = sliced[0].timestamp
    agents = []
    for agent, request in enumerate(sliced):
        peer = PeerRequest(f"mc-r{options.start + agent}", agent, 0, trace_prompt(request, options),
                           options.max_tokens)
        start_s = round((request.timestamp - origin_ms) / 1000 * options.time_scale, 6)
        agents.append(AgentScript(agent, start_s, (AgentStep(0.0, (peer,)),)))
    return _released(Workload("mooncake_slice", tuple(agents), msgspec.structs.asdict(options)))


def mooncake_slice_workload(options: TraceSliceOptions) -> Workload:
    """``trace_slice_workload`` of the trace at ``options.trace_path``."""
    return trace_slice_workload(load_trace(Path(options.trace_path)), options)


def _released(workload: Workload) -> Workload:
    """The workload with every request's ``release_s`` set from starts and think times."""
    agents = []
    for script in workload.agents:
        at_s, steps = script.start_s, []
        for step in script.steps:
            at_s += step.think_s
            steps.append(AgentStep(step.think_s, tuple(
                msgspec.structs.replace(r, release_s=round(at_s, 6)) for r in step.requests)))
        agents.append(AgentScript(script.agent, script.start_s, tuple(steps)))
    return Workload(workload.name, tuple(agents), workload.options)


class Ceiling(msgspec.Struct, frozen=True):
    prompt_tokens: int
    reusable_tokens: int

    @property
    def hit_ratio(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


def ceiling_hit_ratio(requests: Sequence[PeerRequest], tokenize: Callable[[str], list[int]],
                      block_tokens: int) -> Ceiling:
    """The most prompt tokens any cache could reuse (see the module docstring).

    A request may reuse any request before it in release order (ties broken by agent, step,
    sibling): an upper bound, as if computing a prefix once served every later request that
    shares it. ``block_tokens`` is the engines' KV block: hits are whole blocks, and the last
    prompt token is never one.
    """
    assert block_tokens >= 1
    ordered = sorted(requests, key=lambda r: (r.release_s, r.agent, r.step, r.fanout_index))
    token_lists = [tokenize(r.prompt) for r in ordered]
    prompt_tokens = reusable = 0
    for i, tokens in enumerate(token_lists):
        best = max((common_prefix_len(tokens, token_lists[j]) for j in range(i)), default=0)
        prompt_tokens += len(tokens)
        reusable += min(best, len(tokens) - 1) // block_tokens * block_tokens
    return Ceiling(prompt_tokens, reusable)
