"""`dctms run --stop TEXT` and the finish reason: the text ends before the first stop string (which
may span tokens), the report says why the generation ended, and a run ended by its token bound
says so in one stderr line."""

from __future__ import annotations

import json

import pytest
from serve_helpers import build_tiny_models, two_token_stop

from dctms.cli.main import main
from dctms.runner.tokenize import Tokenizer

PROMPT = "stream me"


@pytest.fixture(scope="module")
def beta(tmp_path_factory):
    return build_tiny_models(tmp_path_factory.mktemp("stop-models"))["beta"]


def _run(capsys, served, report, *extra: str) -> tuple[int, str, str, dict | None]:
    argv = ["run", str(served.plan), "--model", str(served.folder), "--prompt", PROMPT,
            "--ignore-chat-template", "--report", str(report), *extra]  # fmt: skip
    rc = main(argv)
    out, err = capsys.readouterr()
    data = json.loads(report.read_text()) if report.exists() else None
    return rc, out, err, data


def test_a_run_ended_by_m_or_max_tokens_says_so(beta, capsys, tmp_path):
    rc, out, err, data = _run(capsys, beta, tmp_path / "m.json")
    assert rc == 0 and data["finish_reason"] == "length" and len(data["tokens"]) == beta.m
    assert err.splitlines()[0] == f"stopped at the plan bound M = {beta.m}"
    rc, out, err, data = _run(capsys, beta, tmp_path / "five.json", "--max-tokens", "5")
    assert rc == 0 and data["finish_reason"] == "length" and len(data["tokens"]) == 5
    assert err.splitlines()[0] == "stopped at --max-tokens 5"
    assert "stop" not in data


def test_stop_ends_the_generation_before_a_string_spanning_tokens(beta, capsys, tmp_path):
    _, _, _, whole = _run(capsys, beta, tmp_path / "whole.json")
    tokenizer = Tokenizer(beta.folder)
    stop, last = two_token_stop(tokenizer, whole["tokens"])
    rc, out, err, data = _run(capsys, beta, tmp_path / "stop.json", "--stop", stop)
    assert rc == 0, err
    want = whole["text"][: whole["text"].find(stop)]
    assert out == want + "\n" and data["text"] == want
    assert data["finish_reason"] == "stop" and data["stop"] == stop
    # generation ended at the token that completed the stop string
    assert data["tokens"] == whole["tokens"][: last + 1]
    assert "stopped at" not in err
    # of two stop strings, the earlier occurrence wins; one never generated changes nothing
    rc, out, _, data = _run(capsys, beta, tmp_path / "two.json", "--stop", "never!", "--stop", stop)
    assert out == want + "\n" and data["stop"] == stop
    rc, out, _, data = _run(capsys, beta, tmp_path / "none.json", "--stop", "never!")
    assert data["text"] == whole["text"] and data["finish_reason"] == "length"




@pytest.mark.parametrize(
    "extra, words",
    [
        (["--stop", ""], "must not be empty"),
        (["--stop", "x", "--draft-model", "somewhere"], "--draft-model"),
        (["--stop", "x", "--ranks", "2"], "--ranks"),
        (["--stop", "x", "--image", "a.png"], "vision-language"),
    ],
    ids=["empty", "speculative", "ranks", "vision"],
)
def test_stop_where_the_text_is_not_followed_is_refused(beta, capsys, tmp_path, extra, words):
    rc, out, err, data = _run(capsys, beta, tmp_path / "refused.json", *extra)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert data is None and out == ""  # refused before generating or writing anything
