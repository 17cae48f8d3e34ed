"""Incremental detokenization with stop strings matched on text, across token boundaries."""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class TextStream:
    """Turns a growing list of token ids into text deltas that are safe to send.

    Text that could still be the start of a stop string, or an incomplete multi-byte character, is held back
    until the next tokens decide it. `update` returns (delta, stopped); after a stop the text ends before the
    stop string and `stop_tokens` is how many output tokens it took to complete it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # everything decoded so far
        self.released = 0  # characters of self.text already returned
        self.stop_tokens: int | None = None
        self.seen = 0  # output tokens decoded by the last update (the stop was not in their text)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def update(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Decode the whole output so far; return the text that can be released and whether a stop string hit."""
        previous, seen = len(self.text), self.seen
        self.text = self._decode(token_ids)
        self.seen = len(token_ids)
        if self.stop:
            start = max(0, min(previous, self.released) - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                cut, hit = min(hits)
                self.stop_tokens = self._tokens_to(token_ids, hit, seen)
                self.text = self.text[:cut]
                return self._release(len(self.text)), True
        end = len(self.text) - self.hold if self.stop else len(self.text)
        while end > self.released and self.text[end - 1 : end] == REPLACEMENT:
            end -= 1  # a character whose bytes are still arriving
        return self._release(end), False

    def flush(self) -> str:
        """The rest of the text (the request finished without a stop string)."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        end = max(end, self.released)
        delta = self.text[self.released : end]
        self.released = end
        return delta

    def _tokens_to(self, token_ids: Sequence[int], stop: str, seen: int) -> int:
        """Fewest leading tokens whose text contains the stop string (more than the `seen` of the last update)."""
        for n in range(seen + 1, len(token_ids) + 1):
            if stop in self._decode(token_ids[:n]):
                return n
        return len(token_ids)
