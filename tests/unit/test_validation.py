"""Request validation: every rule, with the exact fragment of the message a client sees."""

from __future__ import annotations

import json
import math

import pytest

from engine.models import prepare_model
from gateway import json_schemas
from gateway.tokenization import PromptTokenizer
from gateway.validation import check_json_schema, tokenize_prompt, validate_and_build
from protos.baton.v1 import inference_pb2 as pb
from protos.errors import InvalidRequest, UnknownModel
from protos.wire import SamplingOptions

SERVED = "tiny"
MAX_MODEL_LEN = 100
VOCAB_SIZE = 49152

# The tiny model's tokenizer (SmolLM2's) on "Hello world" and on one user chat message "hi",
# which the template renders with its default system prompt and the assistant's header.
HELLO_WORLD_IDS = [19556, 905]
CHAT_HI_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


def make_request(**sampling) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text="Hello world")
    for name, value in sampling.items():
        if name == "stop":
            request.sampling.stop.extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


def build(request: pb.GenerateRequest, tokenizer: PromptTokenizer, max_model_len=MAX_MODEL_LEN):
    return validate_and_build(request, tokenizer, SERVED, max_model_len, VOCAB_SIZE)


def test_text_request_gets_defaults(tokenizer):
    engine_request = build(make_request(), tokenizer)

    assert engine_request.prompt_token_ids == tuple(HELLO_WORLD_IDS)
    assert engine_request.sampling == SamplingOptions(max_tokens=64, temperature=0.0, top_p=1.0)
    assert engine_request.cache_salt == ""
    assert len(engine_request.request_id) == 32
    int(engine_request.request_id, 16)  # a uuid4 hex string


def test_explicit_fields_are_kept(tokenizer):
    request = make_request(max_tokens=5, temperature=0.5, top_p=0.25, seed=7, stop=["\n", "END"])
    request.model = SERVED
    request.cache_salt = "tenant-a"
    request.request_id = "req-1"

    engine_request = build(request, tokenizer)

    assert engine_request.request_id == "req-1"
    assert engine_request.cache_salt == "tenant-a"
    assert engine_request.sampling == SamplingOptions(
        max_tokens=5, temperature=0.5, top_p=0.25, seed=7, stop=("\n", "END")
    )


def test_seed_zero_is_not_unset(tokenizer):
    assert build(make_request(seed=0), tokenizer).sampling.seed == 0


@pytest.mark.parametrize("logprobs", [0, 3, 20])
def test_logprobs_become_num_logprobs_and_zero_is_not_unset(tokenizer, logprobs):
    assert build(make_request(), tokenizer).sampling.num_logprobs is None
    assert build(make_request(logprobs=logprobs), tokenizer).sampling.num_logprobs == logprobs


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_json_schema_is_sent_on_as_compact_json_text(tokenizer):
    request = make_request(json_schema=json.dumps(SCHEMA, indent=2))

    sampling = build(request, tokenizer).sampling

    assert sampling.json_schema == (
        '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}'
    )
    assert (sampling.json_object, sampling.constrained()) == (False, True)


def test_json_object_is_kept(tokenizer):
    sampling = build(make_request(json_object=True), tokenizer).sampling

    assert (sampling.json_schema, sampling.json_object) == ("", True)


@pytest.mark.vllm
def test_a_schema_xgrammar_refuses_but_llguidance_enforces_is_accepted(tokenizer):
    """vLLM's ``auto`` backend falls back to llguidance for ``multipleOf``; so does the front."""
    schema = '{"type":"integer","multipleOf":3}'

    assert build(make_request(json_schema=schema), tokenizer).sampling.json_schema == schema


@pytest.mark.vllm
def test_engines_on_xgrammar_alone_get_that_schema_refused_at_the_front(tokenizer):
    """With ``engine.compact_json`` the engines run xgrammar only (no fallback): the front checks
    for that backend, so the schema the ``auto`` engines take is refused before placement."""
    schema = '{"type":"integer","multipleOf":3}'

    with pytest.raises(InvalidRequest, match="sampling.json_schema is a JSON Schema the "
                       "structured-output backend cannot enforce"):
        validate_and_build(make_request(json_schema=schema), tokenizer, SERVED, MAX_MODEL_LEN,
                           VOCAB_SIZE, structured_backend="xgrammar")
    assert json_schemas.backend_refusal(schema, "xgrammar") is not None
    assert json_schemas.backend_refusal(schema, "auto") is None


def test_the_backend_verdict_is_cached_by_schema_text():
    schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}}
    check_json_schema(schema, "f")
    hits = json_schemas._cached_refusal.cache_info().hits

    check_json_schema(dict(schema), "f")

    assert json_schemas._cached_refusal.cache_info().hits == hits + 1


def test_chat_is_rendered_with_the_template(tokenizer):
    request = pb.GenerateRequest()
    request.chat.messages.add(role="user", content="hi")

    assert build(request, tokenizer).prompt_token_ids == tuple(CHAT_HI_IDS)


def test_token_ids_are_used_as_given(tokenizer):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5, VOCAB_SIZE - 1]))

    assert build(request, tokenizer).prompt_token_ids == (0, 5, VOCAB_SIZE - 1)


def test_default_max_tokens_is_lowered_to_what_fits(tokenizer):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 97))

    assert build(request, tokenizer).sampling.max_tokens == 3


def test_max_tokens_filling_the_context_exactly_is_accepted(tokenizer):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 97))
    request.sampling.max_tokens = 3

    assert build(request, tokenizer).sampling.max_tokens == 3


def _with(**fields):
    """A request built from ``make_request`` then with top-level fields set."""

    def factory():
        request = make_request()
        for name, value in fields.items():
            setattr(request, name, value)
        return request

    return factory


def _chat(*roles):
    def factory():
        request = pb.GenerateRequest()
        request.chat.SetInParent()
        for role in roles:
            request.chat.messages.add(role=role, content="hi")
        return request

    return factory


def _token_ids(ids):
    return lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))


def _sampling(**sampling):
    return lambda: make_request(**sampling)


def _long_prompt_with(**sampling):
    def factory():
        request = make_request(**sampling)
        request.token_ids.ids.extend([1] * 90)
        return request

    return factory


BAD_REQUESTS = {
    "no prompt": (
        lambda: pb.GenerateRequest(),
        "the request has no prompt; set one of text, token_ids or chat",
    ),
    "empty text": (_with(text=""), "prompt text is empty"),
    "empty token ids": (
        lambda: pb.GenerateRequest(token_ids=pb.TokenIds()),
        "prompt token_ids is empty",
    ),
    "empty chat": (_chat(), "chat prompt has no messages"),
    "bad chat role": (
        _chat("user", "bot"),
        "chat message 1 has role 'bot'; use one of system, user, assistant, tool",
    ),
    "negative token id": (
        _token_ids([3, -5, 7]),
        "prompt token id -5 at position 1 is outside the vocabulary [0, 49152)",
    ),
    "token id past vocab": (
        _token_ids([3, 4, VOCAB_SIZE]),
        "prompt token id 49152 at position 2 is outside the vocabulary [0, 49152)",
    ),
    "prompt fills context": (
        _token_ids([1] * MAX_MODEL_LEN),
        "prompt is 100 tokens but the context window (max_model_len) is 100 tokens; "
        "shorten the prompt to at most 99 tokens",
    ),
    "max_tokens zero": (
        _sampling(max_tokens=0),
        "sampling.max_tokens must be positive, got 0; leave it unset for the default (64)",
    ),
    "max_tokens negative": (_sampling(max_tokens=-3), "sampling.max_tokens must be positive"),
    "max_tokens past context": (
        _long_prompt_with(max_tokens=20),
        "prompt (90 tokens) plus sampling.max_tokens (20) exceeds the context window of 100 "
        "tokens; at most 10 new tokens fit, so set max_tokens to 10 or less",
    ),
    "negative temperature": (
        _sampling(temperature=-0.5),
        "sampling.temperature must be a finite number >= 0 (0 is greedy), got -0.5",
    ),
    "nan temperature": (_sampling(temperature=math.nan), "got nan"),
    "infinite temperature": (_sampling(temperature=math.inf), "got inf"),
    "temperature above two": (  # vLLM's SamplingParams refuses it inside the engine
        _sampling(temperature=2.5),
        "sampling.temperature must be at most 2 (the engines' sampler refuses more), got 2.5",
    ),
    "top_p zero": (
        _sampling(top_p=0.0),
        "sampling.top_p must be in (0, 1], got 0.0; leave it unset for 1.0",
    ),
    "top_p above one": (_sampling(top_p=1.5), "sampling.top_p must be in (0, 1], got 1.5"),
    "top_p nan": (_sampling(top_p=math.nan), "sampling.top_p must be in (0, 1], got nan"),
    "too many stop strings": (
        _sampling(stop=[f"s{i}" for i in range(17)]),
        "sampling.stop has 17 strings; at most 16 are allowed",
    ),
    "empty stop string": (_sampling(stop=["a", ""]), "sampling.stop[1] is empty; remove it"),
    "long stop string": (
        _sampling(stop=["x" * 257]),
        "sampling.stop[0] is 257 characters; at most 256 are allowed",
    ),
    "long request id": (
        _with(request_id="r" * 129),
        "request_id is 129 characters; at most 128 are allowed",
    ),
    "non-printable request id": (
        _with(request_id="a\nb"),
        "request_id contains non-printable characters",
    ),
    "logprobs above 20": (
        _sampling(logprobs=21),
        "sampling.logprobs must be an integer from 0 to 20, got 21",
    ),
    "negative logprobs": (
        _sampling(logprobs=-1),
        "sampling.logprobs must be an integer from 0 to 20, got -1",
    ),
    "json_schema and json_object": (
        _sampling(json_schema='{"type": "object"}', json_object=True),
        "sampling.json_schema and sampling.json_object are exclusive",
    ),
    "json_schema not JSON": (
        _sampling(json_schema="{type: object}"),
        "sampling.json_schema is not valid JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)); send the JSON text of a JSON Schema object",
    ),
    "json_schema nested past the parser": (
        _sampling(json_schema="[" * 100_000),
        "sampling.json_schema is not valid JSON (maximum recursion depth exceeded",
    ),
    "json_schema not an object": (
        _sampling(json_schema="[1]"),
        "sampling.json_schema must be a JSON Schema object, got list",
    ),
    "json_schema the backend refuses": pytest.param(
        _sampling(json_schema='{"type": "object", "properties": {"a": {"type": 7}}}'),
        "sampling.json_schema is a JSON Schema the structured-output backend cannot enforce: "
        "Grammar error: type must be a string or array of strings; fix or drop the keywords",
        marks=pytest.mark.vllm,
    ),
    "json_schema nested too deeply": pytest.param(
        _sampling(json_schema='{"items":' * 70 + "{}" + "}" * 70),
        "cannot enforce: The JSON schema is nested too deeply: objects and arrays may nest at "
        "most 64 levels;",
        marks=pytest.mark.vllm,
    ),
    "long cache salt": (
        _with(cache_salt="s" * 257),
        "cache_salt is 257 characters; at most 256 are allowed",
    ),
}


@pytest.mark.parametrize("factory, fragment", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_rejected_with_its_reason(tokenizer, factory, fragment):
    with pytest.raises(InvalidRequest) as info:
        build(factory(), tokenizer)

    assert fragment in str(info.value)


def test_unknown_model_names_the_served_model(tokenizer):
    request = make_request()
    request.model = "llama-70b"

    with pytest.raises(UnknownModel) as info:
        build(request, tokenizer)

    assert str(info.value) == (
        "model 'llama-70b' is not served here; the served model is 'tiny' "
        "(an empty model field also selects it)"
    )


def test_tokenize_prompt_ignores_the_context_window(tokenizer):
    request = pb.TokenizeRequest(token_ids=pb.TokenIds(ids=[1] * (MAX_MODEL_LEN + 5)))

    assert tokenize_prompt(request, tokenizer, SERVED, VOCAB_SIZE) == [1] * (MAX_MODEL_LEN + 5)


def test_tokenize_prompt_checks_model_and_ids(tokenizer):
    with pytest.raises(UnknownModel):
        tokenize_prompt(pb.TokenizeRequest(model="other", text="x"), tokenizer, SERVED, VOCAB_SIZE)
    with pytest.raises(InvalidRequest, match="prompt token id 49152 at position 0"):
        tokenize_prompt(
            pb.TokenizeRequest(token_ids=pb.TokenIds(ids=[VOCAB_SIZE])),
            tokenizer,
            SERVED,
            VOCAB_SIZE,
        )


def test_grpc_regex_and_choice_constraints(tokenizer):
    regex = build(make_request(regex="[ab]+"), tokenizer).sampling
    choice_request = make_request()
    choice_request.sampling.choice.extend(["yes", "no"])
    choice = build(choice_request, tokenizer).sampling
    assert (regex.regex, regex.choice, regex.json_object) == ("[ab]+", (), False)
    assert (choice.regex, choice.choice) == ("", ("yes", "no"))
    assert regex.constrained() and choice.constrained()


@pytest.mark.parametrize("fields, fragment", [
    ({"regex": "[ab]+", "json_object": True},
     "sampling.json_object and sampling.regex are exclusive"),
    ({"regex": "[ab]+", "choice": ["a"]}, "sampling.regex and sampling.choice are exclusive"),
    ({"choice": ["a", "a"]}, "sampling.choice repeats an option"),
    ({"choice": ["a", "x" * 1025]}, "each option must be a non-empty string of at most 1024"),
    ({"regex": "a" * 4097}, "sampling.regex is 4097 characters; at most 4096"),
])  # fmt: skip
def test_grpc_constraints_are_checked(tokenizer, fields, fragment):
    request = make_request()
    for name, value in fields.items():
        if name == "choice":
            request.sampling.choice.extend(value)
        else:
            setattr(request.sampling, name, value)
    with pytest.raises(InvalidRequest, match=fragment.replace("[", r"\[")):
        build(request, tokenizer)


@pytest.mark.vllm
def test_a_regex_the_backend_cannot_enforce_is_refused(tokenizer):
    with pytest.raises(InvalidRequest, match="sampling.regex is a regular expression the "
                                             "structured-output backend cannot enforce"):
        build(make_request(regex="(unclosed"), tokenizer)
