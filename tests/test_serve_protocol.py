"""The server's pure parts: request validation, streaming detokenisation, --plan parsing."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from conftest import make_tiny_plan

from dctms.runner.request import RequestRefused, validate_request
from dctms.runner.stops import StopText
from dctms.schema.errors import DctmsError
from dctms.serve.protocol import ApiError, parse_request, refusal
from dctms.serve.spec import parse_plan_specs


def test_a_plain_completion_request():
    req = parse_request({"model": "m", "prompt": "hi", "max_tokens": 3}, chat=False)
    assert (req.model, req.prompt, req.max_tokens, req.stream) == ("m", "hi", 3, False)
    assert parse_request({"model": "m", "prompt": ["hi"]}, chat=False).prompt == "hi"
    assert parse_request({"model": "m", "prompt": [[5, 6]]}, chat=False).prompt == [5, 6]


def test_chat_request_flattens_text_parts():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        "max_completion_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = parse_request(body, chat=True)
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert (req.max_tokens, req.stream, req.include_usage) == (4, True, True)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "prompt": "x", "temperature": 0.5}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0.9}, "top_p"),
        ({"model": "m", "prompt": "x", "n": 2}, "n"),
        ({"model": "m", "prompt": "x", "n": True}, "n"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": 5}, "stop"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "logprobs": 2}, "logprobs"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt"),
        ({"model": "m"}, "prompt"),
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": "x", "stream_options": 3}, "stream_options"),
    ],
)
def test_refusals_name_the_parameter(body, param):
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=False)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize(
    "messages",
    [None, [], ["hi"], [{"content": "no role"}], [{"role": "user", "content": 3}],
     [{"role": "user", "content": [{"type": "image_url"}]}]],
)
def test_bad_messages_are_refused(messages):
    with pytest.raises(ApiError) as err:
        parse_request({"model": "m", "messages": messages}, chat=True)
    assert err.value.param == "messages"


def _check(plan, ids: list[int], max_tokens: int) -> None:
    """What the server does with a prompt: the runner's check, its refusal worded for HTTP."""
    try:
        validate_request(plan, ids, max_tokens)
    except RequestRefused as err:
        raise refusal("m", err) from None


def test_bounds_name_n_m_and_the_vocabulary():
    tiny = make_tiny_plan()
    plan = msgspec.structs.replace(
        tiny,
        bounds=msgspec.structs.replace(tiny.bounds, input_tokens=4, output_tokens=2),
        model=msgspec.structs.replace(tiny.model, vocab_size=10),
    )
    _check(plan, [1, 2, 3, 4], 2)  # exactly at the bounds
    cases = [
        ((5, 2, [1] * 5), "N = 4"),
        ((4, 3, [1] * 4), "M = 2"),
        ((1, 1, [10]), "vocabulary [0, 10)"),
        ((1, 1, [-1]), "vocabulary"),
        ((0, 1, []), "no tokens"),
    ]
    for (tokens, max_tokens, ids), words in cases:
        assert len(ids) == tokens
        with pytest.raises(ApiError) as err:
            _check(plan, ids, max_tokens)
        assert words in err.value.message and err.value.status == 400


def test_error_body_is_openai_shaped():
    body = ApiError(404, "no such model", "model").body()
    assert body == {
        "error": {"message": "no such model", "type": "invalid_request_error", "param": "model",
                  "code": "model_not_found"}
    }


def _byte_decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_text_stream_never_splits_a_character_and_adds_up():
    ids = list("héllo €!".encode()) + [0xFF, 0x41]  # multi-byte characters, then an invalid byte
    stream = StopText(_byte_decode, hidden={256})
    pieces = [stream.push(t) for t in ids + [256]]
    pieces.append(stream.finish())
    assert "".join(pieces) == _byte_decode(ids)
    assert all("\ufffd" not in p for p in pieces[:-3])  # é and € arrive whole
    assert "é" in pieces and "€" in pieces


def test_text_stream_flushes_an_incomplete_tail_at_the_end():
    stream = StopText(_byte_decode)
    assert stream.push(0xE2) == "" and stream.push(0x82) == ""
    assert stream.finish() == "\ufffd"


def test_plan_specs(tmp_path: Path):
    specs = parse_plan_specs(["a/x.plan=dir1", "fast=b/y.plan=dir2"])
    assert [(s.name, str(s.plan), str(s.model_dir)) for s in specs] == [
        ("x", "a/x.plan", "dir1"),
        ("fast", "b/y.plan", "dir2"),
    ]
    for bad in (["x.plan"], ["a=b=c=d"], ["=x.plan=d"], ["x.plan="], ["a b=x.plan=d"]):
        with pytest.raises(DctmsError):
            parse_plan_specs(bad)
    with pytest.raises(DctmsError, match="served as 'x'"):
        parse_plan_specs(["x.plan=d1", "other/x.plan=d2"])
