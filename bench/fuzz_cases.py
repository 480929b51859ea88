"""Structure-aware fuzz cases: valid requests for each front, each with 1 to 3 seeded mutations.

``fuzz_cases(seed, num_cases, limits)`` starts every case from a valid request of one front
(``FRONTS``): a gRPC ``GenerateRequest`` (text, token ids or a chat, with sampling knobs,
logprobs, a JSON schema or ``json_object``), an OpenAI chat body (tools and ``tool_choice``,
``response_format``, logprobs, stop, stream, a tool-calling history), an OpenAI completions body,
or an Anthropic ``/v1/messages`` body (system, tools, ``tool_use``/``tool_result`` history). The
request is held as its JSON tree, so one set of mutations serves every front:

- ``near``: a field set to another value of its own kind, mostly valid (``max_tokens: 1``,
  ``temperature: 0``, a seed at the int64 edge, an emoji content, 16 stop strings, ...);
- ``drop``: a field (or list element) removed;
- ``hostile``: a field set to a boundary or hostile value (0, -1, 2**31, NaN, inf, a huge or
  NUL-filled or lone-surrogate string, an unknown role or enum, token ids out of the
  vocabulary, ``max_tokens`` past the context, a schema no backend takes);
- ``wrong_type``: a field set to a value of another JSON type;
- ``unknown_field``: a field no front declares, added to an object;
- ``duplicate`` / ``shuffle``: a list's element repeated, or the list shuffled (messages, tools);
- ``long_prompt``: the prompt made 1,500 to 9,000 tokens long (admission rejects the longest
  that fit the context; longer ones are past it);
- ``truncate`` (rare): the serialized bytes cut short.

Most mutations are ``near`` or ``drop`` so that at least half the cases get past the fronts'
checks. A gRPC tree becomes proto bytes through ``json_format``; a mutated value the proto cannot
hold (an int past int32, a string in an int field, a lone surrogate) is appended to the valid
message as a raw field (``bench.fuzz_wire``), so it reaches the server's parser as is. Each case
has its own generator, seeded by ``(seed, index)``: a case replays alone.
"""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any, Callable

import msgspec

from bench.fuzz_wire import Path, proto_bytes, raw_field

FRONTS = ("grpc", "chat", "completions", "messages")
"""gRPC Generate, OpenAI /v1/chat/completions and /v1/completions, Anthropic /v1/messages."""
FRONT_WEIGHTS = (35, 30, 10, 25)
MUTATION_WEIGHTS = {"near": 50, "drop": 12, "hostile": 12, "wrong_type": 5, "unknown_field": 5,
                    "duplicate": 5, "shuffle": 3, "long_prompt": 6, "truncate": 2}
NUM_MUTATIONS = {1: 5, 2: 3, 3: 2}
"""How many mutations a case gets, by weight."""
LONG_PROMPT_TOKENS = (1_500, 3_000, 5_000, 7_000, 9_000)


class Limits(msgspec.Struct, frozen=True):
    """The served model's bounds the hostile values are placed around."""

    vocab_size: int
    max_model_len_tokens: int


class FuzzCase(msgspec.Struct, frozen=True):
    index: int
    front: str
    payload: bytes
    """Proto bytes (gRPC) or the JSON body (HTTP)."""
    headers: dict[str, str]
    mutations: tuple[str, ...]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "days": {"type": "integer"}}, "required": ["city"]}
TEXTS = ("The sky is", "Write one word.", "hello", "Name a colour:", "1, 2, 3,",
         "Ünïcødé ✓ text", "What is the weather in Paris?")
KNOBS: tuple[tuple[str, Any], ...] = (
    ("top_k", 5), ("min_p", 0.05), ("presence_penalty", 0.5), ("frequency_penalty", -0.5),
    ("repetition_penalty", 1.1), ("min_tokens", 1), ("logit_bias", {"100": 5.0}))
"""Sampling knobs a valid request may carry (each rarely), by both spellings' names; a gRPC
``logit_bias`` key is a token id either way (``json_format`` parses map keys from strings)."""
NEAR: dict[str, tuple[Any, ...]] = {
    "max_tokens": (1, 2, 4, 8), "max_completion_tokens": (1, 3),
    "temperature": (0, 0.0, 0.5, 1.0, 2.0, 1e-9), "top_p": (1, 1.0, 0.9, 0.1, 1e-9),
    "seed": (0, 1, -1, 2**63 - 1, -(2**63)), "logprobs": (True, False, 0, 1, 5),
    "top_logprobs": (0, 1, 20), "stop": ((), ("\n",), (".", "!"), ("x" * 256,),
                                        tuple(str(i) for i in range(16)), "stop"),
    "stop_sequences": ((), ("\n",), ("x" * 256,)), "stream": (True, False),
    "include_usage": (True, False), "ignore_eos": (True, False), "json_object": (True, False),
    "content": ("", "hi", "🙂" * 50, "<|im_end|>", "\n\n", '{"json": 1}', "x" * 2_000),
    "text": ("hi", " ", "Ünïcødé ✓", "🙂" * 50, "<|im_start|>user", "x" * 2_000),
    "prompt": ("hi", "🙂" * 50, (100, 200, 300), ("hi",)), "role": ("user", "system", "user"),
    "model": ("tiny", ""), "cache_salt": ("", "tenant-a", "ü" * 256), "tenant": ("", "t"),
    "request_id": ("", "fuzz-dup"), "tool_choice": ("auto", "none", "required"),
    "parallel_tool_calls": (True, False), "disable_parallel_tool_use": (True, False),
    "n": (1,), "user": ("", "u-1"), "description": ("", "x" * 1_000), "is_error": (True, False),
    "system": ("", "Be brief.", ({"type": "text", "text": "Be brief."},)),
    "presence_penalty": (0, 0.0), "echo": (False,), "json_schema": (json.dumps(SCHEMA), "")}
"""Other values of a field's own kind, keyed by field name; mostly valid. Tuples become lists."""
HOSTILE: dict[str, tuple[Any, ...]] = {
    "max_tokens": (0, -1, 2**31, 2**31 - 1, 8_192, 10**6, 2**63),
    "max_completion_tokens": (0, -5, 2**31),
    "temperature": (math.nan, math.inf, -math.inf, -1.0, 2.5, 100.0, 1e308), "top_p": (0, -0.5, 1.5, math.nan),
    "seed": (2**63, -(2**63) - 1, 2**64), "logprobs": (-1, 21, 2**31), "top_logprobs": (-1, 21),
    "stop": (("",), ("x" * 257,), ("a",) * 17), "stop_sequences": (("",), ("x" * 257,)),
    "role": ("root", "", "developer", "function", "USER", "\x00"),
    "model": ("gpt-4", "tiny ", "x" * 10_000), "request_id": ("x" * 129, "a\nb", "fuzz-dup"),
    "cache_salt": ("x" * 257,), "n": (0, 17, -1), "type": ("nope", "", "function_call"),
    "tool_choice": ("any", {"type": "function"},
                    {"type": "function", "function": {"name": "nope"}}),
    "json_schema": ("{", "[]", '{"type": "strin"}', '{"$ref": "#/nope"}',
                    '{"type":"object","properties":{"a":{"type":"string","pattern":"("}}}',
                    '{"items":' * 300 + "{}" + "}" * 300),
    "schema": ([], "x", {"type": "nope"}, {"$ref": "#/x"}), "parameters": ("x", {"type": "nope"}),
    "input_schema": ([], {"type": "nope"}), "name": ("", "x" * 65, "a b", "x" * 10_000),
    "ids": ((),), "presence_penalty": (2.5, -3.0), "logit_bias": ({"5": 101}, {"x": 1}),
    "top_k": (-2,), "min_p": (1.5,), "repetition_penalty": (0.0,),
    "regex": ("(", "a" * 5_000), "choice": ((), ("a", "a"))}
"""Boundary and hostile values by field name; ``_hostile`` adds values by type. ``n`` stays
out of 2..16 here and in ``NEAR``: a served several-choice case places several requests, and
the report's books (``FuzzReport.books_agree``) count one placement per served case."""
BY_TYPE: dict[type, tuple[Any, ...]] = {
    int: (0, -1, 2**31, -(2**31) - 1, 2**63, 2**64),
    float: (math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324),
    str: ("", "x" * 100_000, "\x00" * 16, "\ud800", "🙂" * 1_000, "a\u0000b"),
    list: ((),), dict: ({},)}
OTHER_TYPES = (17, 1.5, "x", True, None, (), {}, (1, "a"))


def _listed(value: Any) -> Any:
    """Pools hold tuples (immutable); trees hold lists."""
    if isinstance(value, tuple):
        return [_listed(v) for v in value]
    if isinstance(value, dict):
        return {k: _listed(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- valid requests, per front

def _sentence(rng: random.Random) -> str:
    return rng.choice(TEXTS)


def _grpc(rng: random.Random, limits: Limits) -> dict:
    kind = rng.choice(("text", "token_ids", "chat"))
    if kind == "text":
        tree: dict = {"text": _sentence(rng)}
    elif kind == "token_ids":
        high = min(40_000, limits.vocab_size)
        ids = [rng.randrange(100, high) for _ in range(rng.randrange(4, 200))]
        tree = {"token_ids": {"ids": ids}}
    else:
        messages = [{"role": "user", "content": _sentence(rng)}]
        if rng.random() < 0.4:
            messages.insert(0, {"role": "system", "content": "Be brief."})
        tree = {"chat": {"messages": messages}}
    sampling: dict = {"max_tokens": rng.randrange(1, 9), "temperature": rng.choice((0.0, 0.7))}
    for key, value in (("top_p", 0.9), ("seed", 7), ("stop", ["\n"]),
                       ("logprobs", rng.randrange(0, 6))):
        if rng.random() < 0.25:
            sampling[key] = value
    for key, value in KNOBS:
        if rng.random() < 0.05:
            sampling[key] = _listed(value)
    structured = rng.random()
    if structured < 0.15:
        sampling["json_schema"] = json.dumps(SCHEMA)
    elif structured < 0.25:
        sampling["json_object"] = True
    elif structured < 0.28:
        sampling["regex"] = "[a-z]{1,6}"
    elif structured < 0.31:
        sampling["choice"] = ["yes", "no"]
    tree["sampling"] = sampling
    for key, value in (("model", "tiny"), ("cache_salt", "t1")):
        if rng.random() < 0.3:
            tree[key] = value
    return tree


def _history_openai() -> list[dict]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _chat(rng: random.Random, limits: Limits) -> dict:
    messages = (_history_openai() if rng.random() < 0.15
                else [{"role": "user", "content": rng.choice((_sentence(rng),
                                                              [{"type": "text", "text": "hi"}]))}])
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "Be brief."})
    tree: dict = {"model": "tiny", "messages": messages, "max_tokens": rng.randrange(1, 9),
                  "temperature": rng.choice((0, 0.7))}
    _http_extras(rng, tree, ("\n", "."))
    if rng.random() < 0.2:
        tree["logprobs"] = True
        tree["top_logprobs"] = rng.randrange(0, 6)
    extra = rng.random()
    if extra < 0.15:
        tree["response_format"] = rng.choice((
            {"type": "json_object"}, {"type": "text"},
            {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}))
    elif extra < 0.35:
        tree["tools"] = [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA}}]
        tree["tool_choice"] = rng.choice(("auto", "none", "required", {
            "type": "function", "function": {"name": "get_weather"}}))
    return tree


def _completions(rng: random.Random, limits: Limits) -> dict:
    prompt = rng.choice((_sentence(rng), [rng.randrange(100, 30_000) for _ in range(20)],
                         [_sentence(rng)]))
    tree: dict = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randrange(1, 9),
                  "temperature": rng.choice((0, 0.7))}
    _http_extras(rng, tree, ("\n",))
    if rng.random() < 0.2:
        tree["logprobs"] = rng.randrange(0, 6)
    return tree


def _http_extras(rng: random.Random, tree: dict, stop: tuple[str, ...]) -> None:
    if rng.random() < 0.35:
        tree["stream"] = True
        if rng.random() < 0.5:
            tree["stream_options"] = {"include_usage": True}
    for key, value in (("top_p", 0.9), ("seed", 11), ("stop", list(stop)), ("user", "u"),
                       ("cache_salt", "t1"), ("presence_penalty", 0)):
        if rng.random() < 0.15:
            tree[key] = value
    for key, value in KNOBS:
        if rng.random() < 0.05:
            tree[key] = _listed(value)


def _messages(rng: random.Random, limits: Limits) -> dict:
    if rng.random() < 0.15:
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "sunny"}]}]
    else:
        messages = [{"role": "user", "content": rng.choice((
            _sentence(rng), [{"type": "text", "text": _sentence(rng)}]))}]
    tree: dict = {"model": "tiny", "max_tokens": rng.randrange(1, 9), "messages": messages}
    for key, value in (("system", "Be brief."), ("temperature", 0.0), ("top_p", 0.9),
                       ("stop_sequences", ["\n"]), ("metadata", {"user_id": "u"})):
        if rng.random() < 0.2:
            tree[key] = value
    if rng.random() < 0.35:
        tree["stream"] = True
    if rng.random() < 0.2:
        tree["tools"] = [{"name": "get_weather", "description": "Weather for a city",
                          "input_schema": SCHEMA}]
        tree["tool_choice"] = rng.choice(({"type": "auto"}, {"type": "any"}, {"type": "none"},
                                          {"type": "tool", "name": "get_weather"}))
    return tree


BASES: dict[str, Callable[[random.Random, Limits], dict]] = {
    "grpc": _grpc, "chat": _chat, "completions": _completions, "messages": _messages}


# ---------------------------------------------------------------- the tree and its mutations

def _nodes(tree: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    """Every node below the root, parents first."""
    found: list[tuple[Path, Any]] = []
    children = (tree.items() if isinstance(tree, dict)
                else enumerate(tree) if isinstance(tree, list) else ())
    for key, value in children:
        found.append((path + (key,), value))
        found.extend(_nodes(value, path + (key,)))
    return found


def _parent(tree: Any, path: Path) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _name(path: Path) -> str:
    """The field a path ends in: its last string key (a list element is named by its list)."""
    return next((key for key in reversed(path) if isinstance(key, str)), "")


def _where(path: Path) -> str:
    return ".".join(str(key) for key in path) or "(root)"


def _long_prompt(rng: random.Random, tree: dict, front: str, limits: Limits) -> str:
    num_tokens = rng.choice(LONG_PROMPT_TOKENS)
    text = " sky" * num_tokens
    if front == "grpc":
        for kind in ("chat", "text", "token_ids"):
            tree.pop(kind, None)
        if rng.random() < 0.5:
            tree["token_ids"] = {"ids": [rng.randrange(100, min(40_000, limits.vocab_size))
                                         for _ in range(num_tokens)]}
        else:
            tree["text"] = text
    elif front == "completions":
        tree["prompt"] = text
    elif isinstance(tree.get("messages"), list) and tree["messages"]:
        tree["messages"][-1] = {"role": "user", "content": text}
    else:
        return "long_prompt:(no messages)"
    return f"long_prompt:{num_tokens}"


Mutation = tuple[str, tuple[Path, Any] | None]
"""What a mutation did, and the ``(path, value)`` it set, if it set one."""


def _mutate(rng: random.Random, tree: dict, front: str, limits: Limits, op: str) -> Mutation:
    """Apply ``op`` somewhere in ``tree``."""
    nodes = _nodes(tree)
    if op == "long_prompt":
        return _long_prompt(rng, tree, front, limits), None
    if op == "near":
        nodes_near = [(p, v) for p, v in nodes if _name(p) in NEAR and not isinstance(p[-1], int)]
        if nodes_near:
            path, _ = rng.choice(nodes_near)
            return _set(tree, path, _listed(rng.choice(NEAR[_name(path)])), op)
        op = "hostile"
    if op in ("duplicate", "shuffle"):
        lists = [(p, v) for p, v in nodes if isinstance(v, list) and v]
        if lists:
            path, items = rng.choice(lists)
            if op == "duplicate":
                items.insert(rng.randrange(len(items) + 1), copy.deepcopy(rng.choice(items)))
            else:
                rng.shuffle(items)
            return f"{op}:{_where(path)}", None
        op = "unknown_field"
    if op == "unknown_field":
        objects = [((), tree)] + [(p, v) for p, v in nodes if isinstance(v, dict)]
        path, _ = rng.choice(objects)
        name = rng.choice(("fuzz_unknown", "logit_bias", "thinking", "best_of", "extra"))
        return _set(tree, path + (name,), _listed(rng.choice(OTHER_TYPES)), op)
    if not nodes:
        return f"{op}:(empty)", None
    path, value = rng.choice(nodes)
    if op == "drop":
        del _parent(tree, path)[path[-1]]
        return f"drop:{_where(path)}", None
    if op == "wrong_type":
        return _set(tree, path, _listed(rng.choice(
            [v for v in OTHER_TYPES if type(v) is not type(value)])), op)
    return _set(tree, path, _hostile(rng, _name(path), value, limits), op)


def _set(tree: dict, path: Path, value: Any, op: str) -> Mutation:
    _parent(tree, path)[path[-1]] = value
    return f"{op}:{_where(path)}={value!r:.40}", (path, value)


def _hostile(rng: random.Random, name: str, value: Any, limits: Limits) -> Any:
    pool = list(HOSTILE.get(name, ())) + list(BY_TYPE.get(type(value), ()))
    if name == "ids" or (isinstance(value, int) and name in ("ids", "prompt")):
        pool += [limits.vocab_size, -1, 2**31 - 1, (100,) * (limits.max_model_len_tokens + 1)]
    if name in ("max_tokens", "max_completion_tokens"):
        pool += [limits.max_model_len_tokens, limits.max_model_len_tokens - 1]
    return _listed(rng.choice(pool)) if pool else _listed(rng.choice(OTHER_TYPES))


def _grpc_mutations(rng: random.Random, tree: dict, ops: list[str], limits: Limits
                    ) -> tuple[list[tuple[Path, Any]], list[str]]:
    """Apply ``ops``; a value the proto cannot hold is undone in the tree and kept apart, to be
    sent raw."""
    raw: list[tuple[Path, Any]] = []
    done = []
    for op in ops:
        before = copy.deepcopy(tree)
        what, set_at = _mutate(rng, tree, "grpc", limits, op)
        if proto_bytes(tree) is None:
            tree.clear()
            tree.update(before)
            if set_at is not None:
                raw.append(set_at)
                what += " (raw)"
        done.append(what)
    return raw, done


def fuzz_case(seed: int, index: int, limits: Limits) -> FuzzCase:
    """Case ``index`` of ``seed``'s run, on its own generator."""
    rng = random.Random(f"{seed}:{index}")
    front = rng.choices(FRONTS, FRONT_WEIGHTS)[0]
    tree = BASES[front](rng, limits)
    num_mutations = rng.choices(list(NUM_MUTATIONS), list(NUM_MUTATIONS.values()))[0]
    ops = rng.choices(list(MUTATION_WEIGHTS), list(MUTATION_WEIGHTS.values()), k=num_mutations)
    truncate = "truncate" in ops
    ops = [op for op in ops if op != "truncate"]
    headers = {"content-type": "application/json"} if front != "grpc" else {}
    raw: list[tuple[Path, Any]] = []
    if front == "grpc":
        tree.setdefault("request_id", f"fuzz-{seed}-{index}")
        raw, done = _grpc_mutations(rng, tree, ops, limits)
    else:
        headers["x-request-id"] = "fuzz-dup" if rng.random() < 0.03 else f"fuzz-{seed}-{index}"
        done = [_mutate(rng, tree, front, limits, op)[0] for op in ops]
    if front == "grpc":
        payload = proto_bytes(tree)
        assert payload is not None, "every value the proto cannot hold was kept apart"
        payload += b"".join(raw_field(path, value) for path, value in raw)
    else:
        payload = json.dumps(tree).encode()
    if truncate:
        cut = rng.randrange(len(payload)) if payload else 0
        done.append(f"truncate:{cut}/{len(payload)}")
        payload = payload[:cut]
    return FuzzCase(index, front, payload, headers, tuple(done))


def fuzz_cases(seed: int, num_cases: int, limits: Limits) -> list[FuzzCase]:
    return [fuzz_case(seed, index, limits) for index in range(num_cases)]
