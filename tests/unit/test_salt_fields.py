"""The fronts' salt-offset fields (``gateway.salts``): gRPC ``cache_salt_offset``; HTTP
``cache_salt_offset`` and, on chat routes, ``cache_salt_from_message`` (the token where that
message starts in the rendered prompt). Exact offsets, and every refusal naming its field."""

from __future__ import annotations

import pytest

from engine.models import prepare_model
from gateway.anthropic_models import MessagesRequest
from gateway.anthropic_requests import prepare_message
from gateway.openai_errors import OpenAIError
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from gateway.openai_requests import ServedModel, prepare
from gateway.salts import common_prefix_len
from gateway.tokenization import PromptTokenizer
from gateway.validation import validate_and_build
from protos.baton.v1 import inference_pb2 as pb
from protos.errors import InvalidRequest

SERVED = ServedModel("tiny", 4096, 49152)
IM_START = 1  # SmolLM2's <|im_start|>: every rendered message starts with it
SYSTEM = "You are the public trunk: a long shared system prompt. " * 4
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


def chat(tokenizer, **fields):
    body = ChatCompletionRequest(model="tiny", messages=MESSAGES, **fields)
    return prepare(body, tokenizer, SERVED).engine


def refused(call) -> dict:
    with pytest.raises(OpenAIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value.body["error"]


def test_cache_salt_from_message_is_where_that_message_starts(tokenizer):
    before = tokenizer.encode_conversation(MESSAGES[:2], add_generation_prompt=False)
    engine = chat(tokenizer, cache_salt="A", cache_salt_from_message=2)
    prompt = engine.prompt_token_ids
    assert engine.cache_salt_offset == len(before) and prompt[:len(before)] == tuple(before)
    assert prompt[engine.cache_salt_offset] == IM_START
    system_only = chat(tokenizer, cache_salt="A", cache_salt_from_message=1)
    assert system_only.cache_salt_offset == len(
        tokenizer.encode_conversation(MESSAGES[:1], add_generation_prompt=False))
    assert chat(tokenizer, cache_salt="A", cache_salt_from_message=0).cache_salt_offset == 0
    assert chat(tokenizer, cache_salt="A").cache_salt_offset == 0
    assert chat(tokenizer, tenant="A", cache_salt_offset=7).cache_salt_offset == 7


def test_http_salt_fields_are_refused_by_name(tokenizer):
    num_tokens = len(chat(tokenizer).prompt_token_ids)
    cases = [
        ({"cache_salt": "A", "cache_salt_offset": -1}, "cache_salt_offset", "from 0 to"),
        ({"cache_salt": "A", "cache_salt_offset": num_tokens + 1}, "cache_salt_offset",
         f"{num_tokens} tokens"),
        ({"cache_salt_offset": 3}, "cache_salt_offset", "no cache_salt"),
        ({"cache_salt": "A", "cache_salt_from_message": 4}, "cache_salt_from_message",
         "one of the 4 messages"),
        ({"cache_salt": "A", "cache_salt_from_message": -1}, "cache_salt_from_message",
         "one of the 4 messages"),
        ({"cache_salt_from_message": 1}, "cache_salt_from_message", "no cache_salt"),
        ({"cache_salt": "A", "cache_salt_offset": 3, "cache_salt_from_message": 1},
         "cache_salt_from_message", "send one of them"),
    ]
    for fields, param, fragment in cases:
        error = refused(lambda: chat(tokenizer, **fields))
        assert error["param"] == param and fragment in error["message"], (fields, error)
    assert chat(tokenizer, cache_salt="A", cache_salt_offset=num_tokens).cache_salt_offset == (
        num_tokens)


def test_completions_take_a_token_offset_only(tokenizer):
    body = CompletionRequest(model="tiny", prompt="Hello world, once more", cache_salt="A",
                             cache_salt_offset=2)
    assert prepare(body, tokenizer, SERVED).engine.cache_salt_offset == 2
    body = CompletionRequest(model="tiny", prompt="Hello", cache_salt="A",
                             cache_salt_from_message=0)
    assert refused(lambda: prepare(body, tokenizer, SERVED))["param"] == "cache_salt_from_message"


def test_anthropic_message_index_counts_messages_not_the_system(tokenizer):
    def message(**fields):
        body = MessagesRequest(model="tiny", max_tokens=4, system=SYSTEM, messages=MESSAGES[1:],
                               **fields)
        return prepare_message(body, tokenizer, SERVED).engine

    last = message(cache_salt="A", cache_salt_from_message=2)  # MESSAGES[3], after the system
    before = tokenizer.encode_conversation(MESSAGES[:3], add_generation_prompt=False)
    assert last.cache_salt_offset == len(before) == common_prefix_len(before,
                                                                       last.prompt_token_ids)
    first = message(cache_salt="A", cache_salt_from_message=0)
    assert first.cache_salt_offset == len(
        tokenizer.encode_conversation(MESSAGES[:1], add_generation_prompt=False))
    assert message(cache_salt="B", cache_salt_offset=5).cache_salt_offset == 5
    with pytest.raises(OpenAIError) as caught:
        message(cache_salt="A", cache_salt_from_message=3)
    assert caught.value.body["error"]["param"] == "cache_salt_from_message"


def grpc_request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(10, 30))), **fields)


def build(request):
    return validate_and_build(request, None, "tiny", 4096, 49152)


def test_grpc_cache_salt_offset_is_checked_and_carried():
    assert build(grpc_request(cache_salt="A", cache_salt_offset=12)).cache_salt_offset == 12
    assert build(grpc_request(cache_salt="A", cache_salt_offset=20)).cache_salt_offset == 20
    assert build(grpc_request(cache_salt="A")).cache_salt_offset == 0
    for fields, fragment in (({"cache_salt": "A", "cache_salt_offset": -1}, "from 0 to"),
                             ({"cache_salt": "A", "cache_salt_offset": 21}, "prompt's 20 tokens"),
                             ({"cache_salt_offset": 0}, "no cache_salt")):
        with pytest.raises(InvalidRequest, match="cache_salt_offset") as caught:
            build(grpc_request(**fields))
        assert fragment in str(caught.value)


def test_anthropic_tool_results_are_turns_of_their_message(tokenizer):
    from gateway.anthropic_requests import conversation
    from gateway.tool_calls import render

    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny"}, {"type": "text", "text": "thanks"}]},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    body = MessagesRequest(model="tiny", max_tokens=4, system=SYSTEM, messages=messages,
                           cache_salt="A", cache_salt_from_message=4)
    engine = prepare_message(body, tokenizer, SERVED).engine
    turns = conversation(body.system, body.messages)
    assert [t.role for t in turns] == ["system", "user", "assistant", "tool", "user",
                                       "assistant", "user"]
    rendered = render(turns[:6], None, tokenizer.renders_tools)
    before = tokenizer.encode_conversation(rendered.messages, add_generation_prompt=False)
    assert engine.cache_salt_offset == len(before)
    assert engine.prompt_token_ids[:len(before)] == tuple(before)


@pytest.mark.parametrize("offset", [0, 130, 300])
def test_the_gateways_keys_and_a_continuations_follow_the_segments(offset):
    from gateway.live_router import continuation, prompt_blocks
    from kvstore.keys import KeyExtras, first_salted_block, pack_keys, prompt_block_keys
    from protos.wire import EngineRequest, SamplingOptions

    prompt, generated = tuple(range(1000, 1300)), [7] * 100
    extras = KeyExtras("tiny", "A", "", "f32:128", first_salted_block(offset, 128))
    blocks = prompt_blocks(prompt, "A", "tiny", "f32:128", 128, cache_salt_offset=offset)
    assert blocks.keys == pack_keys(prompt_block_keys(prompt, 128, extras))
    request = EngineRequest("r", prompt, SamplingOptions(max_tokens=200), cache_salt="A",
                            cache_salt_offset=offset, blocks=blocks)
    moved = continuation(request, generated)
    assert moved.blocks.keys == pack_keys(prompt_block_keys(prompt + tuple(generated), 128, extras))
