"""The OpenAI-compatible HTTP front over real uvicorn, driven by the official ``openai`` client.

A scripted ``FakeRouter`` (the gateway tests') stands in for placement and workers, so these
tests are about the HTTP wire only: shapes, usage, errors and their statuses, auth, health,
metrics, disconnects and concurrency.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import prometheus_client
import pytest
import pytest_asyncio

from engine.models import prepare_model
from gateway.inference import NOT_READY_MESSAGE
from gateway.openai_http import build_app, error_for, start_http
from gateway.tokenization import PromptTokenizer
from protos.errors import ConfigError, NoWorkerReady, WorkerFailed
from protos.wire import PositionLogprobs, SamplingOptions, TokenChunk, TokenLogprob
from tests.unit.test_gateway_wire import PLACEMENT, SCRIPTED_CHUNKS, FakeRouter

SERVED = "tiny"
MAX_MODEL_LEN = 100
API_KEY = "sk-test"
HELLO_WORLD_IDS = [19556, 905]
EXPECTED_BATON = {
    "placement": {
        "prefill": "prefill-0",
        "decode": "decode-1",
        "policy": "kv-aware",
        "reason": PLACEMENT.reason,
        "transfer_ms": PLACEMENT.transfer_ms,
        "queue_ms": PLACEMENT.queue_ms,
        "prefill_ms": PLACEMENT.prefill_ms,
        "expected_cached_blocks": PLACEMENT.expected_cached_blocks,
        "pulled_from": PLACEMENT.pulled_from,
    },
    "loaded_tokens": 12,
}


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


class RouterSlot:
    """The module's server routes through whichever ``FakeRouter`` the current test made."""

    current: FakeRouter

    def is_ready(self) -> bool:
        return self.current.is_ready()

    def stream(self, request):
        return self.current.stream(request)


@pytest.fixture(scope="module")
def slot() -> RouterSlot:
    return RouterSlot()


@pytest.fixture
def router(slot) -> FakeRouter:
    slot.current = FakeRouter()
    return slot.current


@pytest.fixture(scope="module")
def registry() -> prometheus_client.CollectorRegistry:
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter(
        "baton_test_requests", "Requests seen by the test.", registry=registry
    ).inc(3)
    return registry


@pytest_asyncio.fixture(scope="module")
async def running(slot, tokenizer, registry):
    app = build_app(slot, tokenizer, SERVED, MAX_MODEL_LEN, frozenset({API_KEY}), registry)
    running = await start_http(app, "127.0.0.1", 0)
    yield running
    await running.stop(grace_s=1.0)


@pytest.fixture
def server(running, router):
    """The running server, serving this test's ``router``."""
    return running


@pytest_asyncio.fixture
async def client(server):
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY, max_retries=0
    ) as client:
        yield client


@pytest_asyncio.fixture
async def http(server):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as http:
        yield http


AUTH = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "hi"}]


def without_ttft(baton: dict) -> dict:
    baton = dict(baton)
    assert baton.pop("ttft_ms") > 0
    return baton


async def test_chat_completion_text_usage_and_baton_extras(client, router, tokenizer):
    completion = await client.chat.completions.create(
        model=SERVED,
        messages=HI,
        max_tokens=4,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop=["\n", "END"],
        user="alice",
        extra_body={"tenant": "acme"},
    )

    assert completion.object == "chat.completion"
    assert completion.model == SERVED
    [choice] = completion.choices
    assert (choice.message.role, choice.message.content) == ("assistant", "abcd")
    assert choice.finish_reason == "stop"
    chat_ids = tokenizer.encode_chat([("user", "hi")])
    assert completion.usage.prompt_tokens == len(chat_ids)
    assert completion.usage.completion_tokens == 4
    assert completion.usage.total_tokens == len(chat_ids) + 4
    assert completion.usage.prompt_tokens_details.cached_tokens == 16
    assert without_ttft(completion.model_extra["baton"]) == EXPECTED_BATON
    [engine_request] = router.requests
    assert completion.id == f"chatcmpl-{engine_request.request_id}"
    assert engine_request.prompt_token_ids == tuple(chat_ids)
    assert engine_request.sampling == SamplingOptions(
        max_tokens=4, temperature=0.5, top_p=0.9, seed=7, stop=("\n", "END")
    )
    assert engine_request.cache_salt == "acme"
    assert router.num_closed_streams == 1


async def test_completion_text_and_token_id_prompts(client, router):
    text = await client.completions.create(
        model=SERVED,
        prompt="Hello world",
        max_tokens=5,
        extra_body={"cache_salt": "salt-1", "tenant": "ignored"},
    )
    ids = await client.completions.create(model=SERVED, prompt=[[1, 2, 3]])

    assert text.object == "text_completion"
    assert [(c.text, c.finish_reason) for c in text.choices] == [("abcd", "stop")]
    assert text.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 16},
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 16,
    }
    assert ids.choices[0].text == "abcd"
    assert ids.usage.prompt_tokens == 3
    first, second = router.requests
    assert first.prompt_token_ids == tuple(HELLO_WORLD_IDS)
    assert (first.sampling.max_tokens, first.sampling.temperature) == (5, 1.0)
    assert first.cache_salt == "salt-1"
    assert second.prompt_token_ids == (1, 2, 3)
    assert second.sampling.max_tokens == 64  # the shared default, not the whole window
    assert second.cache_salt == ""


async def test_streaming_chat_with_usage(client, tokenizer):
    stream = await client.chat.completions.create(
        model=SERVED,
        messages=HI,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]

    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk.id for chunk in chunks}) == 1
    *content, finish, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == "abcd"
    assert [c.usage for c in content + [finish]] == [None] * (len(content) + 1)
    assert finish.choices[0].finish_reason == "stop"
    assert without_ttft(finish.model_extra["baton"]) == EXPECTED_BATON
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(tokenizer.encode_chat([("user", "hi")])),
        4,
    )
    assert last.usage.prompt_tokens_details.cached_tokens == 16


async def test_streaming_completion_without_usage(client):
    stream = await client.completions.create(model=SERVED, prompt="Hello world", stream=True)
    chunks = [chunk async for chunk in stream]

    assert "".join(chunk.choices[0].text for chunk in chunks) == "abcd"
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "stop"
    assert all(chunk.usage is None for chunk in chunks)


def _lp(token_id: int, token: str, logprob: float, rank: int = 1) -> TokenLogprob:
    return TokenLogprob(token_id, token, logprob, rank)


PROMPT_LOGPROBS = (  # "Hello world": the second token's, as an engine computes it
    PositionLogprobs(_lp(905, " world", -3.5, 2), (_lp(11, ",", -0.5), _lp(905, " world", -3.5, 2))),
)
ECHO_CHUNKS = (
    TokenChunk((5, 6), "ab", prompt_logprobs=PROMPT_LOGPROBS,
               logprobs=(PositionLogprobs(_lp(5, "a", -0.25), (_lp(5, "a", -0.25),)),
                         PositionLogprobs(_lp(6, "b", -1.0, 2), (_lp(7, "x", -0.75),)))),
    TokenChunk((8,), "d", finish_reason="stop",
               logprobs=(PositionLogprobs(_lp(8, "d", -0.125), (_lp(8, "d", -0.125),)),)),
)
ECHOED_LOGPROBS = {
    "tokens": ["Hello", " world", "a", "b", "d"],
    "token_logprobs": [None, -3.5, -0.25, -1.0, -0.125],
    "top_logprobs": [None, {",": -0.5, " world": -3.5}, {"a": -0.25}, {"x": -0.75, "b": -1.0},
                     {"d": -0.125}],
    "text_offset": [0, 5, 11, 12, 13],
}
"""The echoed answer's log-probabilities: the prompt's first token without one, then the
prompt's others and the answer's, offsets counted from the prompt's first character."""


async def test_echo_answers_the_prompt_first_with_its_logprobs(http, router):
    router.chunks = ECHO_CHUNKS
    body = {"model": SERVED, "prompt": "Hello world", "max_tokens": 3, "echo": True,
            "logprobs": 1}
    reply = await http.post("/v1/completions", json=body, headers=AUTH)

    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    assert choice["text"] == "Hello worldabd"
    assert choice["logprobs"] == ECHOED_LOGPROBS
    [request] = router.requests
    assert (request.sampling.num_logprobs, request.sampling.num_prompt_logprobs) == (1, 1)


async def test_echo_streams_the_prompt_in_the_first_chunk(http, router):
    router.chunks = ECHO_CHUNKS
    body = {"model": SERVED, "prompt": "Hello world", "max_tokens": 3, "echo": True,
            "logprobs": 1, "stream": True}
    choices = []
    async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                choices.extend(json.loads(line[6:])["choices"])
    texts = [choice["text"] for choice in choices if choice["text"]]
    assert texts == ["Hello worldab", "d"]
    merged = {key: [] for key in ECHOED_LOGPROBS}
    for choice in choices:
        for key, values in (choice["logprobs"] or {}).items():
            merged[key].extend(values)
    assert merged == ECHOED_LOGPROBS


async def test_echo_with_max_tokens_0_answers_the_prompt_alone(http, router):
    """What a client scoring a text sends: the prompt and its log-probabilities, nothing
    generated (the engine's one token dropped), finish "length", no completion tokens."""
    router.chunks = ECHO_CHUNKS
    body = {"model": SERVED, "prompt": "Hello world", "max_tokens": 0, "echo": True,
            "logprobs": 1}
    whole = (await http.post("/v1/completions", json=body, headers=AUTH)).json()
    choices, usage = [], None
    async with http.stream("POST", "/v1/completions", json=body | {"stream": True,
                           "stream_options": {"include_usage": True}}, headers=AUTH) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                choices.extend(chunk["choices"])
                usage = chunk.get("usage") or usage

    prompt_only = {key: values[:2] for key, values in ECHOED_LOGPROBS.items()}
    [choice] = whole["choices"]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == (
        "Hello world", "length", prompt_only)
    assert (whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"]) == (2, 0)
    assert "".join(c["text"] for c in choices) == "Hello world"
    assert choices[-1]["finish_reason"] == "length"
    assert [c["logprobs"] for c in choices if c["logprobs"]] == [prompt_only]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 0)
    assert [r.sampling.max_tokens for r in router.requests] == [1, 1]


async def test_max_tokens_0_without_echo_is_still_refused(http, router):
    body = {"model": SERVED, "prompt": "Hello world", "max_tokens": 0}
    reply = await http.post("/v1/completions", json=body, headers=AUTH)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_tokens"
    assert router.requests == []


async def test_echo_without_logprobs_asks_the_engine_for_none(client, router, tokenizer):
    text = await client.completions.create(model=SERVED, prompt="Hello world", max_tokens=4,
                                           echo=True)
    ids = await client.completions.create(model=SERVED, prompt=[1, 2, 3], max_tokens=4, echo=True)
    plain = await client.completions.create(model=SERVED, prompt="Hello world", max_tokens=4,
                                            logprobs=1)

    assert text.choices[0].text == "Hello worldabcd"
    assert ids.choices[0].text == tokenizer.decode([1, 2, 3]) + "abcd"
    assert plain.choices[0].text == "abcd"
    # the prompt's log-probabilities only for an echo with logprobs
    assert [r.sampling.num_prompt_logprobs for r in router.requests] == [None, None, None]


async def test_raw_sse_framing_ends_with_done(http):
    body = {"model": SERVED, "prompt": "Hello world", "stream": True}
    async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
        raw = (await response.aread()).decode()

    assert response.headers["content-type"].startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])


BAD_REQUESTS = {
    "negative temperature": (
        "chat", {"messages": HI, "temperature": -1}, "temperature",
        "sampling.temperature must be a finite number >= 0",
    ),
    "empty prompt": ("completion", {"prompt": ""}, "prompt", "prompt is empty"),
    "n=17": ("completion", {"prompt": "x", "n": 17}, "n", "n must be from 1 to 16"),
    "n=0": ("chat", {"messages": HI, "n": 0}, "n", "n must be from 1 to 16"),
    "two prompts": (
        "completion", {"prompt": ["a", "b"]}, "prompt", "only one prompt per request",
    ),
    "bad role": (
        "chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages",
        "messages[0] has role 'robot'",
    ),
    "token id outside vocabulary": (
        "completion", {"prompt": [1, 99999]}, "prompt",
        "prompt token id 99999 at position 1 is outside the vocabulary",
    ),
    "prompt too long": (
        "completion", {"prompt": [1] * 100}, "prompt", "prompt is 100 tokens but the context",
    ),
    "max_tokens too large": (
        "completion", {"prompt": "x", "max_tokens": 100}, "max_tokens", "at most 99 new tokens fit",
    ),
    "empty stop string": ("completion", {"prompt": "x", "stop": [""]}, "stop", "is empty"),
    "presence_penalty over 2": ("chat", {"messages": HI, "presence_penalty": 2.5},
                                "presence_penalty", "must be in [-2, 2]"),
    "frequency_penalty under -2": ("completion", {"prompt": "x", "frequency_penalty": -2.5},
                                   "frequency_penalty", "must be in [-2, 2]"),
    "logit_bias key not a token id": ("chat", {"messages": HI, "logit_bias": {"hi": 1}},
                                      "logit_bias", "is not a token id"),
    "logit_bias bias over 100": ("chat", {"messages": HI, "logit_bias": {"5": 101}},
                                 "logit_bias", "must be in [-100, 100]"),
    "top_k under -1": ("chat", {"messages": HI, "extra_body": {"top_k": -2}}, "top_k",
                       "must be an integer"),
    "min_p over 1": ("completion", {"prompt": "x", "extra_body": {"min_p": 1.5}}, "min_p",
                     "must be in [0, 1]"),
    "repetition_penalty 0": ("completion", {"prompt": "x", "extra_body": {"repetition_penalty": 0}},
                             "repetition_penalty", "must be greater than 0"),
    "structured_outputs grammar": ("chat", {"messages": HI, "extra_body": {"structured_outputs": {
        "grammar": "root ::= x"}}}, "structured_outputs", "structured_outputs.grammar is not served"),
    "structured_outputs two keys": ("completion", {"prompt": "x", "extra_body": {
        "structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs",
        "must set exactly one of json, regex, choice, got ['choice', 'regex']"),
    "structured_outputs and response_format": ("chat", {
        "messages": HI, "response_format": {"type": "json_object"},
        "extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}, "structured_outputs",
        "response_format and structured_outputs both fix the output's shape"),
    "choice repeats": ("chat", {"messages": HI, "extra_body": {"structured_outputs": {
        "choice": ["a", "a"]}}}, "structured_outputs", "structured_outputs.choice repeats"),
    "choice empty option": ("chat", {"messages": HI, "extra_body": {"structured_outputs": {
        "choice": ["a", ""]}}}, "structured_outputs", "each option must be a non-empty string"),
    "min_tokens over max_tokens": ("completion", {"prompt": "x", "max_tokens": 4,
                                                  "extra_body": {"min_tokens": 5}},
                                   "min_tokens", "from 0 to the request's max_tokens (4)"),
}  # fmt: skip


@pytest.mark.parametrize(
    "endpoint, fields, param, fragment", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys()
)
async def test_bad_input_is_bad_request(client, router, endpoint, fields, param, fragment):
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create

    with pytest.raises(openai.BadRequestError) as info:
        await create(model=SERVED, **fields)

    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["param"] == param
    assert fragment in info.value.body["message"]
    assert router.requests == []


async def test_the_sampling_knobs_reach_the_engine_request(client, router):
    """top_k, min_p, the penalties, min_tokens and logit_bias (ids as OpenAI's JSON spells them:
    strings) arrive in the request the router places, as given; unset they are neutral."""
    await client.chat.completions.create(
        model=SERVED, messages=HI, max_tokens=6, presence_penalty=0.5, frequency_penalty=-1.0,
        logit_bias={"17": 2.5, "3": -100},
        extra_body={"top_k": 4, "min_p": 0.25, "repetition_penalty": 1.5, "min_tokens": 2})
    await client.completions.create(model=SERVED, prompt="x", max_tokens=6)

    knobs, neutral = [(r.sampling.top_k, r.sampling.min_p, r.sampling.presence_penalty,
                       r.sampling.frequency_penalty, r.sampling.repetition_penalty,
                       r.sampling.min_tokens, r.sampling.logit_bias) for r in router.requests]
    assert knobs == (4, 0.25, 0.5, -1.0, 1.5, 2, ((3, -100.0), (17, 2.5)))
    assert neutral == (0, 0.0, 0.0, 0.0, 1.0, 0, ())


async def test_structured_outputs_constraints_reach_the_engine_request(client, router):
    """vLLM's ``structured_outputs`` extension: ``choice``, ``regex``, and ``json`` (a schema as
    an object or as its JSON text, the same as ``response_format``'s)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for spec in ({"choice": ["yes", "no"]}, {"regex": "[ab]+"}, {"json": schema},
                 {"json": json.dumps(schema), "regex": None}):
        await client.chat.completions.create(model=SERVED, messages=HI, max_tokens=4,
                                             extra_body={"structured_outputs": spec})

    constraints = [(r.sampling.choice, r.sampling.regex, r.sampling.json_schema)
                   for r in router.requests]
    compact = json.dumps(schema, separators=(",", ":"))
    assert constraints == [(("yes", "no"), "", ""), ((), "[ab]+", ""), ((), "", compact),
                           ((), "", compact)]
    assert all(r.sampling.constrained() for r in router.requests)


async def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-4o", messages=HI)

    assert info.value.body == {
        "message": "model 'gpt-4o' is not served here; the served model is 'tiny' "
        "(an empty model field also selects it)",
        "type": "invalid_request_error",
        "param": "model",
        "code": "unknown_model",
    }


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b'{"prompt": "x",', "the request body is not valid JSON"),
        (b'{"prompt": "x", "temperature": "hot"}', "temperature: Input should be a valid number"),
        (b'{"model": "tiny"}', "prompt: Field required"),
        (b"[1, 2]", "request body: Input should be a valid dictionary"),
        (b'{"prompt": "x", "user": "\\ud800"}',
         "the string at user holds a lone UTF-16 surrogate escape"),
    ],
    ids=["malformed json", "wrong type", "missing prompt", "not an object", "lone surrogate"],
)
async def test_malformed_body_is_400_in_openai_format(http, router, content, fragment):
    response = await http.post(
        "/v1/completions",
        content=content,
        headers=AUTH | {"Content-Type": "application/json"},
    )

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]
    assert router.requests == []


IGNORED_OTHERWISE = {
    "completion tools": ("completion", {"tools": [{"type": "function", "function": {"name": "f"}}]},
                         "tool calling is served on /v1/chat/completions"),
    "functions": ("chat", {"functions": [{"name": "f"}]}, "send the functions as tools"),
    "completion top_logprobs": ("completion", {"top_logprobs": 2},
                                "top_logprobs is the chat endpoint's; on /v1/completions send "
                                "logprobs: k"),
    "best_of": ("completion", {"best_of": 2}, "only 1 is accepted"),
    "chat echo": ("chat", {"echo": True}, "echo is served on /v1/completions, not here"),
    "unknown field": ("completion", {"frobnicate": 1}, "unknown field 'frobnicate'"),
}  # fmt: skip


@pytest.mark.parametrize("endpoint, fields, fragment", IGNORED_OTHERWISE.values(),
                         ids=IGNORED_OTHERWISE.keys())
async def test_a_field_the_front_would_ignore_is_refused_by_name(http, router, endpoint, fields,
                                                                 fragment):
    """Nothing is silently ignored: a field Baton does not act on is a 400 naming it, nothing
    reaches the router, and the next request is served."""
    path, base = (("/v1/chat/completions", {"messages": HI}) if endpoint == "chat"
                  else ("/v1/completions", {"prompt": "x"}))
    [name] = fields

    refused = await http.post(path, json={"model": SERVED, **base, **fields}, headers=AUTH)
    served = await http.post(path, json={"model": SERVED, **base}, headers=AUTH)

    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", name, "invalid_request")
    assert fragment in error["message"]
    assert served.status_code == 200
    assert len(router.requests) == 1


async def test_neutral_values_of_unserved_fields_are_accepted(client, http, router):
    """Values that ask for nothing pass: what clients send by habit, and what vLLM's own
    ``bench serve`` sends (``repetition_penalty: 1.0``, ``logprobs: null``, ``ignore_eos``,
    which Baton serves)."""
    await client.chat.completions.create(
        model=SERVED, messages=HI, logprobs=False, top_logprobs=0, presence_penalty=0,
        frequency_penalty=0.0,
        response_format={"type": "text"}, tool_choice="none", user="agent-7",
        extra_body={"tools": []},
    )
    bench = await http.post("/v1/completions", headers=AUTH, json={
        "model": SERVED, "prompt": "x", "repetition_penalty": 1.0, "max_tokens": 4,
        "logprobs": None, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})

    assert bench.status_code == 200
    chat, completion = router.requests
    assert chat.sampling.ignore_eos is False
    assert completion.sampling.ignore_eos is True
    for neutral in (chat.sampling, completion.sampling):  # nothing asked: nothing computed
        assert (neutral.num_logprobs, neutral.json_schema, neutral.json_object) == (None, "", False)


async def test_api_key_is_required_on_v1_only(server, http):
    wrong = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sk-wrong", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError) as info:
        await wrong.models.list()
    await wrong.close()
    missing = await http.post("/v1/completions", json={"prompt": "x"})

    assert info.value.body["code"] == "invalid_api_key"
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/metrics")).status_code == 200


async def test_models_lists_the_served_model(client):
    models = await client.models.list()
    model = await client.models.retrieve(SERVED)

    assert [(m.id, m.object, m.owned_by) for m in models.data] == [(SERVED, "model", "baton")]
    assert model.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")


async def test_health_follows_router_readiness_and_requests_get_503(http, client, router):
    ok = await http.get("/health")
    router.ready = False
    not_ready = await http.get("/health")

    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(model=SERVED, messages=HI)

    assert (ok.status_code, ok.json()) == (200, {"status": "ok"})
    assert not_ready.status_code == 503
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["message"] == NOT_READY_MESSAGE
    assert info.value.body["code"] == "no_worker_ready"
    assert router.requests == []


async def test_metrics_exposes_the_given_registry(http):
    response = await http.get("/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "baton_test_requests_total 3.0" in response.text


async def test_worker_failure_is_503_or_a_stream_error(client, router):
    router.error = WorkerFailed("decode-1 died; the request was not completed")
    router.chunks = SCRIPTED_CHUNKS[:1]

    with pytest.raises(openai.InternalServerError) as info:
        await client.completions.create(model=SERVED, prompt="x")
    stream = await client.completions.create(model=SERVED, prompt="x", stream=True)
    texts = []
    with pytest.raises(openai.APIError) as stream_info:
        async for chunk in stream:
            texts.append(chunk.choices[0].text)

    assert info.value.status_code == 503
    assert info.value.body["message"] == "decode-1 died; the request was not completed"
    assert texts == ["ab"]
    assert stream_info.value.message == "decode-1 died; the request was not completed"
    assert stream_info.value.body["code"] == "worker_failed"
    assert router.num_closed_streams == 2


class RefusingRouter(FakeRouter):
    """Refuses every request before placing it, as a router with no free instance does."""

    async def stream(self, request):
        self.requests.append(request)
        raise NoWorkerReady("every decode instance is full; retry in a second")
        yield  # an async generator, like a real router's stream


async def test_refusal_before_placement_is_503_even_when_streaming(tokenizer):
    router = RefusingRouter()
    running = await start_http(build_app(router, tokenizer, SERVED, MAX_MODEL_LEN), "127.0.0.1", 0)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{running.port}/v1", api_key="unused", max_retries=0
    )
    try:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=SERVED, messages=HI, stream=True)
    finally:
        await client.close()
        await running.stop(grace_s=1.0)

    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["message"] == "every decode instance is full; retry in a second"


def test_resource_exhausted_maps_to_429_with_retry_after():
    from conductor.policy import Overloaded

    error = error_for(Overloaded("the queue holds 512 requests; retry in 3 s", retry_after_s=3))

    assert error.status == 429
    assert error.headers == {"Retry-After": "3"}
    assert error.body == {
        "error": {
            "message": "the queue holds 512 requests; retry in 3 s",
            "type": "rate_limit_error",
            "param": None,
            "code": "overloaded",
        }
    }


async def test_unexpected_router_error_is_500(client, router):
    router.error = KeyError("boom")
    router.chunks = ()

    with pytest.raises(openai.InternalServerError) as info:
        await client.completions.create(
            model=SERVED, prompt="x", extra_headers={"X-Request-Id": "req-9"}
        )

    assert info.value.status_code == 500
    assert info.value.body["message"] == (
        "internal error while serving request req-9; the gateway log has the details"
    )


async def wait_for_closed_streams(router: FakeRouter, expected: int) -> None:
    for _ in range(200):
        if router.num_closed_streams >= expected:
            break
        await asyncio.sleep(0.01)
    assert router.num_closed_streams == expected


async def test_disconnect_mid_stream_closes_the_router_stream(http, router):
    router.chunks = SCRIPTED_CHUNKS[:1]
    router.hang = True
    body = {"model": SERVED, "messages": HI, "stream": True}

    async with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as response:
        lines = response.aiter_lines()
        first = await anext(lines)
        while not (line := await anext(lines)).startswith("data:"):
            pass
        second = json.loads(line.removeprefix("data: "))
        assert router.num_closed_streams == 0

    assert response.status_code == 200
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
    assert second["choices"][0]["delta"] == {"content": "ab"}
    await wait_for_closed_streams(router, 1)


async def test_disconnect_while_waiting_for_a_full_completion_closes_the_router_stream(
    http, router
):
    router.hang = True

    with pytest.raises(httpx.ReadTimeout):
        await http.post(
            "/v1/completions", json={"prompt": "x"}, headers=AUTH, timeout=0.3
        )

    await wait_for_closed_streams(router, 1)


async def test_32_concurrent_streams_all_complete(client, router):
    async def one(index: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=SERVED,
            prompt=f"request {index}",
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        return text, chunks[-1].usage.completion_tokens

    results = await asyncio.gather(*(one(index) for index in range(32)))

    assert results == [("abcd", 4)] * 32
    assert len(router.requests) == 32
    assert len({request.request_id for request in router.requests}) == 32
    assert router.num_closed_streams == 32


async def test_taken_port_is_a_config_error(server, router, tokenizer):
    app = build_app(router, tokenizer, SERVED, MAX_MODEL_LEN)

    with pytest.raises(ConfigError, match=f"could not bind 127.0.0.1:{server.port}"):
        await start_http(app, "127.0.0.1", server.port)


async def test_tls_is_one_switch_and_plain_http_or_untrusted_clients_are_refused(tokenizer, tmp_path):
    from gateway.config import HttpConfig
    from tests.tls import self_signed

    cert, key = self_signed(tmp_path, "front")
    other_ca, _ = self_signed(tmp_path, "impostor")
    config = HttpConfig(port=0, tls_cert_file=str(cert), tls_key_file=str(key))
    app = build_app(FakeRouter(), tokenizer, SERVED, MAX_MODEL_LEN, frozenset({API_KEY}))
    running = await start_http(app, config.host, config.port, tls=config.tls_files())
    try:
        async with httpx.AsyncClient(verify=str(cert), timeout=10) as https:
            health = await https.get(f"https://127.0.0.1:{running.port}/health")
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            completion = await https.post(
                f"https://127.0.0.1:{running.port}/v1/completions", headers=AUTH,
                json={"model": SERVED, "prompt": "hi", "max_tokens": 4})
            assert completion.json()["choices"][0]["text"] == "abcd"
        async with httpx.AsyncClient(timeout=5) as plain:
            with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
                await plain.get(f"http://127.0.0.1:{running.port}/health")
        async with httpx.AsyncClient(verify=str(other_ca), timeout=5) as untrusting:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.get(f"https://127.0.0.1:{running.port}/health")
        async with openai.AsyncOpenAI(
            base_url=f"https://127.0.0.1:{running.port}/v1", api_key=API_KEY, max_retries=0,
            http_client=httpx.AsyncClient(verify=str(cert)),
        ) as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == [SERVED]
    finally:
        await running.stop(grace_s=1.0)


def test_http_tls_needs_both_files_and_a_loadable_pair(tmp_path):
    from pydantic import ValidationError

    from cluster.config import load_config
    from gateway.config import HttpConfig
    from tests.tls import self_signed

    with pytest.raises(ValidationError, match="http TLS needs both tls_cert_file and tls_key_file"):
        HttpConfig(tls_key_file="key.pem")
    cert, key = self_signed(tmp_path, "front")
    _, other_key = self_signed(tmp_path, "other")
    for cert_file, key_file, field in ((tmp_path / "c.pem", key, "tls_cert_file"),
                                       (cert, tmp_path / "k.pem", "tls_key_file")):
        with pytest.raises(ConfigError, match=f"^http.{field}: cannot read .*: No such file"):
            load_config(None, {"http.tls_cert_file": str(cert_file),
                               "http.tls_key_file": str(key_file)}).http.tls_files()
    (tmp_path / "c.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="http.tls_cert_file .*c.pem and http.tls_key_file: not a "
                                          "PEM certificate chain and its private key"):
        HttpConfig(tls_cert_file=str(tmp_path / "c.pem"), tls_key_file=str(key)).tls_files()
    with pytest.raises(ConfigError, match="not a PEM certificate chain and its private key"):
        HttpConfig(tls_cert_file=str(cert), tls_key_file=str(other_key)).tls_files()  # not its key
    assert HttpConfig().tls_files() is None
    assert HttpConfig(tls_cert_file=str(cert), tls_key_file=str(key)).tls_files() == (str(cert), str(key))


# ---------------------------------------------------------------- n > 1


class FailingChoice(FakeRouter):
    """A ``FakeRouter`` whose stream for one choice's request (``fails``) fails after its first
    chunk, and whose other streams hang after theirs (so only closing ends them)."""

    def __init__(self, fails: str):
        super().__init__(chunks=SCRIPTED_CHUNKS[:1], hang=True)
        self.fails = fails

    async def stream(self, request):
        if request.request_id.endswith(self.fails):
            self.error, self.hang = WorkerFailed("decode-1 died"), False
        try:
            async for event in super().stream(request):
                yield event
        finally:
            self.error, self.hang = None, True


async def test_n_choices_are_one_engine_request_each_answered_together(http, router, tokenizer):
    response = await http.post("/v1/chat/completions", headers=AUTH | {"X-Request-Id": "req9"},
                               json={"model": SERVED, "messages": HI, "n": 3, "seed": 7,
                                     "session_id": "agent-1"})

    assert response.status_code == 200
    assert response.headers["X-Request-Id"] == "req9"
    answer = response.json()
    assert answer["id"] == "chatcmpl-req9"
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in answer["choices"]] \
        == [(0, "abcd", "stop"), (1, "abcd", "stop"), (2, "abcd", "stop")]
    assert [(r.request_id, r.sampling.seed) for r in router.requests] == [
        ("req9", 7), ("req9-n1", 8), ("req9-n2", 9)]
    assert router.requests[0].prompt_token_ids == router.requests[2].prompt_token_ids
    assert router.requests[0].session_id and [r.session_id for r in router.requests[1:]] == [
        "", ""]  # the session's step is the first choice
    num_prompt_tokens = len(tokenizer.encode_chat([("user", "hi")]))
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"],
            answer["usage"]["total_tokens"]) == (num_prompt_tokens, 12, num_prompt_tokens + 12)
    assert [without_ttft(b) for b in answer["baton"]["choices"]] == [EXPECTED_BATON] * 3
    assert router.num_closed_streams == 3


async def test_n_choices_stream_interleaved_each_with_its_own_finish(client, router):
    stream = await client.completions.create(model=SERVED, prompt="Hello world", n=2,
                                             stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]

    *choice_chunks, last = chunks
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in choice_chunks:
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
            assert without_ttft(chunk.model_extra["baton"]) == EXPECTED_BATON
    assert texts == {0: "abcd", 1: "abcd"}
    assert finishes == {0: "stop", 1: "stop"}
    assert (last.choices, last.usage.completion_tokens) == ([], 8)
    assert [r.sampling.seed for r in router.requests] == [None, None]
    assert router.num_closed_streams == 2


async def test_one_failing_choice_fails_the_answer_and_closes_every_stream(client, slot):
    slot.current = router = FailingChoice(fails="-n1")
    with pytest.raises(openai.InternalServerError) as info:
        await client.completions.create(model=SERVED, prompt="x", n=3)
    assert info.value.body["message"] == "decode-1 died"
    assert router.num_closed_streams == 3

    slot.current = router = FailingChoice(fails="-n2")
    stream = await client.completions.create(model=SERVED, prompt="x", n=3, stream=True)
    with pytest.raises(openai.APIError) as stream_info:
        async for _chunk in stream:
            pass
    assert stream_info.value.message == "decode-1 died"
    await asyncio.sleep(0.1)  # the answer's background task closes the router's streams
    assert router.num_closed_streams == 3
