"""The request-field table (serve.fields): every field the `openai` client can send is in it, each
is honoured, ignored or refused with a 400 naming it as the table says, and the serving guide
(docs/how-to/serving.md) shows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dctms.serve.fields import FIELDS, PATHS, RECOMPILE, fields_for, fields_markdown
from dctms.serve.protocol import ApiError, parse_request

openai = pytest.importorskip("openai")
from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

SERVING = Path(__file__).resolve().parents[1] / "docs" / "how-to" / "serving.md"

# A value that asks for the feature, for every field the table refuses (greedy or not).
ASKING = {
    "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
    "repetition_context_size": 32,
    "logit_bias": {"5": 10}, "seed": 7, "logprobs": True, "top_logprobs": 2,
    "n": 2, "best_of": 3, "echo": True, "suffix": "tail", "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
    "functions": [{"name": "f"}], "function_call": "auto",
    "response_format": {"type": "json_object"}, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {},
    "moderation": {"policy": None}, "store": True, "service_tier": "flex",
}  # fmt: skip
# A valid value for every field the table honours or ignores.
GIVEN = {
    "max_tokens": 3, "max_completion_tokens": 3, "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": False}, "stop": ["\n"],
    "return_token_ids": True, "user": "u1", "safety_identifier": "s", "metadata": {"k": "v"},
    "prompt_cache_key": "c", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit"}, "parallel_tool_calls": False,
}  # fmt: skip
BASE = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "completions": {"model": "m", "prompt": "hi"},
}


def _parse(endpoint: str, **extra):
    return parse_request({**BASE[endpoint], **extra}, chat=endpoint == "chat")


def _client_fields(module) -> set[str]:
    return set(module.CompletionCreateParamsStreaming.__annotations__)


@pytest.mark.parametrize(
    "endpoint, module", [("chat", chat_params), ("completions", completion_params)]
)
def test_every_field_the_openai_client_can_send_is_in_the_table(endpoint, module):
    sent = _client_fields(module)
    assert "stream" in sent and "model" in sent  # the client's own params were read
    missing = sent - set(fields_for(endpoint))
    assert not missing, f"{PATHS[endpoint]}: fields missing from serve.fields: {sorted(missing)}"


def test_the_samples_cover_the_table():
    refused = {f.name for f in FIELDS if f.verdict in ("greedy", "refused")}
    assert set(ASKING) == refused
    assert set(GIVEN) | {"model", "messages", "prompt"} == {
        f.name for f in FIELDS if f.verdict in ("honoured", "ignored")
    }


@pytest.mark.parametrize("field", [f for f in FIELDS if f.verdict in ("greedy", "refused")],
                         ids=lambda f: f.name)
def test_a_refused_field_is_a_400_naming_it_and_why_unless_it_asks_nothing(field):
    for endpoint in field.endpoints:
        with pytest.raises(ApiError) as err:
            _parse(endpoint, **{field.name: ASKING[field.name]})
        assert err.value.status == 400 and err.value.param == field.name
        assert repr(field.name) in err.value.message
        why = RECOMPILE if field.verdict == "greedy" else field.why
        assert why in err.value.message
        for value in (None, *field.neutral):
            assert _parse(endpoint, **{field.name: value}).model == "m"


@pytest.mark.parametrize("field", [f for f in FIELDS if f.verdict in ("honoured", "ignored")],
                         ids=lambda f: f.name)
def test_an_honoured_or_ignored_field_is_accepted(field):
    for endpoint in field.endpoints:
        if field.name in GIVEN:
            assert _parse(endpoint, **{field.name: GIVEN[field.name]}).model == "m"


def test_a_field_of_the_other_endpoint_or_unknown_is_refused():
    with pytest.raises(ApiError) as err:
        _parse("completions", messages=[{"role": "user", "content": "x"}])
    assert err.value.param == "messages" and "/v1/chat/completions" in err.value.message
    with pytest.raises(ApiError) as err:
        _parse("chat", max_token=5)  # a misspelt max_tokens must not generate up to M
    assert err.value.param == "max_token" and "unknown field" in err.value.message
    with pytest.raises(ApiError) as err:
        _parse("completions", suffix="x")
    assert err.value.param == "suffix"


def test_honoured_fields_reach_the_request():
    chat = _parse("chat", max_completion_tokens=4, max_tokens=9, stop="\n\n", stream=True,
                  stream_options={"include_usage": True}, user="someone")  # fmt: skip
    assert (chat.max_tokens, chat.stop, chat.stream, chat.include_usage) == (4, ("\n\n",), True, True)
    plain = _parse("completions", stop=["a", "b"], max_tokens=2)
    assert (plain.stop, plain.max_tokens, plain.stream) == (("a", "b"), 2, False)
    assert _parse("completions", stop=None).stop == () and _parse("completions", stop=[]).stop == ()


def test_the_serving_guide_shows_the_table():
    assert fields_markdown() in SERVING.read_text(encoding="utf-8")
