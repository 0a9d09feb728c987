"""The service's text pieces alone: incremental detokenizing and stop strings (no server)."""
from __future__ import annotations

import random

import pytest

from g4rt.models.tiny import ensure_tiny
from g4rt.runtime.service.text import IncrementalDetokenizer, StopStrings, Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(ensure_tiny())


def _piece(d: IncrementalDetokenizer, new_ids: list[int], final: bool = False) -> str:
    """One stream's piece: `window` and `advance` around its own decode (the service decodes a step's streams
    in one call, outputs.py)."""
    ids = d.window(new_ids, final)
    return "" if ids is None else d.advance(d.tok.decode_many(ids, d.skip), final)


def test_streamed_pieces_add_up_to_the_one_shot_decode(tok):
    rng = random.Random(0)
    for trial in range(200):
        ids = [rng.randrange(4, tok.vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = tok.encode(["héllo 日本"])[0]
        d = IncrementalDetokenizer(tok, prompt)
        pieces = []
        i = 0
        while i < len(ids):  # tokens arrive one or a few per step
            n = rng.randint(1, 3)
            pieces.append(_piece(d, ids[i:i + n]))
            i += n
        pieces.append(_piece(d, [], final=True))
        assert "".join(pieces) == tok.decode(ids), trial
        assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in tok.decode(ids)


def test_multibyte_characters_are_never_split(tok):
    text = "日本語 🎉 wörld"
    ids = tok.encode([text], add_special_tokens=False)[0]
    d = IncrementalDetokenizer(tok, [2])
    pieces = [_piece(d, [i]) for i in ids] + [_piece(d, [], final=True)]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert len([p for p in pieces if p]) < len(ids)  # some tokens were held until their character completed


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_spanning_pieces(include):
    s = StopStrings(("STOP", "xy"), include)
    out = [s.feed(p) for p in ("abc S", "T", "OP and more")]
    assert "".join(out) == ("abc STOP" if include else "abc ") and s.hit
    assert s.feed("later") == ""


def test_without_a_stop_everything_comes_out():
    s = StopStrings(("zz",))
    out = [s.feed(p) for p in ("a", "bz", "c")] + [s.feed("", final=True)]
    assert "".join(out) == "abzc" and not s.hit
    assert out == ["", "ab", "z", "c"]  # the last character is held back while it could begin "zz"


def test_min_tokens_is_a_lower_bound(tok):
    rng = random.Random(1)
    for _ in range(50):
        text = "".join(rng.choice("ab 日🎉\n") for _ in range(rng.randint(0, 300)))
        assert tok.min_tokens(text) <= len(tok.encode([text], add_special_tokens=False)[0])
