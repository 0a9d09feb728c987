"""Text around the token stream: tokenizing with a bound, incremental detokenizing, stop strings.

Every call into `tokenizers` goes through its batch entry points, which release the GIL: a 1 MiB
prompt tokenizing on a worker thread then does not stall the event loop or the engine thread.
"""
from __future__ import annotations

from dataclasses import dataclass


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the service needs to bound work before doing it."""

    def __init__(self, tok):
        self.tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        # Bytes one token can stand for at most (its vocabulary string in UTF-8 is an upper bound for
        # byte-level and SentencePiece vocabularies alike): a text of B bytes is >= B / this tokens.
        self.max_token_bytes = max(len(s.encode()) for s in vocab) or 1
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir) -> "Tokenizer | None":
        from pathlib import Path

        from tokenizers import Tokenizer as HFTokenizer
        path = Path(model_dir) / "tokenizer.json"
        return cls(HFTokenizer.from_file(str(path))) if path.is_file() else None

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), known without tokenizing."""
        return len(text.encode()) // self.max_token_bytes

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def decode_many(self, id_lists: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """One call for many decodes: a step's streams share it (a call costs more than a short decode)."""
        return self.tok.decode_batch(id_lists, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token decoded alone (logprobs name tokens this way; a partial character shows as U+FFFD)."""
        return self.tok.decode_batch([[i] for i in ids], skip_special_tokens=False)


class IncrementalDetokenizer:
    """The text of a growing token list, handed out in pieces that never split a character.

    It decodes a short window of tokens twice, without and with the new ones, and emits the
    difference once it no longer ends in U+FFFD (an incomplete UTF-8 sequence); byte-level and
    SentencePiece tokenizers alike then stream exactly the text a one-shot decode gives.

    In two halves, so that a step's streams decode in one `Tokenizer.decode_many` call (outputs.py):
    `window(new_ids, final)` takes the tokens and says what to decode, `advance(texts, final)` takes
    those decodes and returns the piece.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-4:])  # context: some tokenizers decode a leading token differently
        self.prefix = 0
        self.read = len(self.ids)

    def window(self, new_ids: list[int], final: bool = False) -> list[list[int]] | None:
        """Append `new_ids`; the window's ids without and with the tokens not yet handed out, to decode
        and pass to `advance`, or None when no text can come out (no new ids, not final)."""
        self.ids += new_ids
        if not new_ids and not final:
            return None
        return [self.ids[self.prefix:self.read], self.ids[self.prefix:]]

    def advance(self, texts: list[str], final: bool = False) -> str:
        """The piece that `window`'s decodes `texts` give. `final`: the end, where whatever is left comes
        out (an incomplete character as U+FFFD, as a one-shot decode gives it)."""
        before, after = texts
        if final:
            self.prefix = self.read = len(self.ids)
            return after[len(before):]
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


@dataclass
class StopStrings:
    """Finds stop strings in streamed text, including ones that span tokens.

    `feed(piece)` returns the text safe to emit now: everything except a tail that could still be the
    start of a stop string. When a stop string is found, `hit` is set and the text up to it (or through
    it, with `include`) is the last thing returned. It keeps only the text a stop string could still
    overlap (`text`, of which the first `emitted` characters went out), so a token costs the same at
    the end of a long generation as at its start.
    """

    stops: tuple[str, ...]
    include: bool = False
    text: str = ""
    emitted: int = 0
    hit: bool = False

    def feed(self, piece: str, final: bool = False) -> str:
        if not self.stops:
            return piece
        if self.hit:
            return ""
        longest = max(len(s) for s in self.stops)
        self.text += piece
        found = [(i, s) for s in self.stops if (i := self.text.find(s, max(0, self.emitted - longest))) >= 0]
        if found:
            i, s = min(found)
            end = i + len(s) if self.include else i
            self.hit = True
        elif final:
            end = len(self.text)
        else:
            end = max(self.emitted, len(self.text) - longest + 1)
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        keep = max(0, self.emitted - longest)
        self.text, self.emitted = self.text[keep:], self.emitted - keep
        return out
