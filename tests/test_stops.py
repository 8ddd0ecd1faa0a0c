"""Stop strings over generated text (runner.stops): the cut, the held-back tail, the finish reason."""

from __future__ import annotations

import pytest

from dctms.runner.stops import StopText, earliest_stop, finish_reason, held_tail

# A toy vocabulary of multi-character pieces, so a stop string can span tokens.
VOCAB = ["Hel", "lo", " wor", "ld", "!", "\n", "END", "E", "N", "D", "x"]
EOS = 99


def _decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i < len(VOCAB))


def _ids(*pieces: str) -> list[int]:
    return [VOCAB.index(p) for p in pieces]


def _feed(text: StopText, ids: list[int]) -> list[str]:
    """Push ids until the text stops (as the session does); the pieces, with finish() last."""
    pieces = []
    for t in ids:
        pieces.append(text.push(t))
        if text.stopped:
            break
    pieces.append(text.finish())
    return pieces


def test_a_stop_spanning_tokens_ends_the_text_before_it():
    text = StopText(_decode, ["o wo"])
    pieces = _feed(text, _ids("Hel", "lo", " wor", "ld"))
    assert text.stopped and text.stopped_at == "o wo"
    assert text.text == "Hell" and "".join(pieces) == "Hell"
    # it stopped at the token completing the stop string: "ld" was never fed
    assert len(pieces) == 3 + 1


def test_a_tail_that_could_begin_a_stop_is_held_then_released():
    text = StopText(_decode, ["END"])
    assert text.push(VOCAB.index("Hel")) == "Hel"
    assert text.push(VOCAB.index("E")) == ""  # could be the start of END
    assert text.push(VOCAB.index("N")) == ""
    assert text.push(VOCAB.index("x")) == "ENx"  # it was not: released
    assert not text.stopped


def test_a_stop_split_across_tokens_is_dropped_with_its_held_start():
    text = StopText(_decode, ["END"])
    pieces = _feed(text, _ids("Hel", "E", "N", "D", "x"))
    assert pieces == ["Hel", "", "", "", ""]
    assert text.text == "Hel" and text.stopped


def test_the_earliest_of_several_stops_wins():
    text = StopText(_decode, ["!", "wor"])
    _feed(text, _ids("Hel", "lo", " wor", "ld", "!"))
    assert text.text == "Hello " and text.stopped_at == "wor"


def test_a_stop_in_the_first_token_leaves_no_text():
    text = StopText(_decode, ["Hel"])
    assert _feed(text, _ids("Hel", "lo")) == ["", ""]
    assert text.text == "" and text.stopped


def test_without_a_stop_the_pieces_add_up_to_the_whole_text():
    ids = _ids("Hel", "lo", "E", " wor", "ld", "E", "N")
    text = StopText(_decode, ["END"])
    pieces = _feed(text, ids)
    assert "".join(pieces) == _decode(ids) and not text.stopped
    assert pieces[-1] == "EN"  # held to the end, released by finish()


def test_hidden_ids_never_show():
    text = StopText(_decode, (), hidden={VOCAB.index("!")})
    _feed(text, _ids("Hel", "!", "lo"))
    assert text.text == "Hello"


def test_a_stop_after_an_incomplete_character_is_found_once_it_completes():
    def byte_decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    text = StopText(byte_decode, ["€!"])
    pieces = _feed(text, list("a€!b".encode()))
    assert text.text == "a" and "".join(pieces) == "a" and text.stopped


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopText(_decode, [""])


def test_earliest_stop_and_held_tail():
    assert earliest_stop("abcabc", ["c", "b"]) == (1, "b")
    assert earliest_stop("abc", ["x"]) == (3, None)
    assert held_tail("hello E", ["END"]) == 1
    assert held_tail("hello EN", ["END", "NX"]) == 2
    assert held_tail("hello", ["END"]) == 0
    assert held_tail("", ["END"]) == 0


def test_finish_reason():
    assert finish_reason([1, 2, EOS], {EOS}, stopped=False) == "stop"
    assert finish_reason([1, 2], {EOS}, stopped=True) == "stop"
    assert finish_reason([1, 2], {EOS}, stopped=False) == "length"
    assert finish_reason([], {EOS}, stopped=False) == "length"
