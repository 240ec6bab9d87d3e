"""Generated ids as text, the way a stream needs it: Detokenizer (leading spaces kept by decoding after the
last prompt tokens, an incomplete UTF-8 character held back) and StopWatcher (stop strings: where a generation
must end so that no stop string, nor a token holding part of one, is shown).

Does not know: models, the engine (StopWatcher is handed to Engine.generate as its should_stop callback),
what the text is shown on.
"""
from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Text of generated ids. They are decoded after the last few prompt tokens, so tokenizers that drop a
    word's leading space at the start of a decode (SentencePiece) keep it; special tokens are skipped."""

    CONTEXT = 4

    def __init__(self, tokenizer, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.prefix = list(prompt_ids[-self.CONTEXT:])
        self.prefix_text = self._decode(self.prefix)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def text(self, ids: Sequence[int]) -> str:
        full = self._decode(self.prefix + list(ids))
        if full.startswith(self.prefix_text):
            return full[len(self.prefix_text):]
        return self._decode(list(ids))

    def stable_text(self, ids: Sequence[int]) -> str:
        """text(ids) without a trailing replacement character (an incomplete multi-byte character)."""
        return self.text(ids).rstrip("\ufffd")


class StopWatcher:
    """Engine.generate's should_stop callback for stop strings: on the first stop string in the decoded text,
    keep the tokens whose text ends before it (a token that holds part of the stop string is dropped)."""

    def __init__(self, detok: Detokenizer, stops: Sequence[str]) -> None:
        self.detok, self.stops = detok, list(stops)
        self.longest = max(len(s) for s in self.stops)
        self.keep: int | None = None

    def __call__(self, ids: list[int]) -> int | None:
        text = self.detok.text(ids)
        hits = [text.find(s) for s in self.stops if s in text]
        if not hits:
            return None
        self.keep = self._tokens_within(ids, min(hits), 0)
        return self.keep

    def safe_count(self, ids: list[int], start: int) -> int:
        """How many leading tokens cannot be part of a stop string that the next tokens may complete."""
        boundary = len(self.detok.text(ids)) - (self.longest - 1)
        return self._tokens_within(ids, boundary, start)

    def _tokens_within(self, ids: list[int], n_chars: int, start: int) -> int:
        """The largest k >= start with len(text(ids[:k])) <= n_chars (k = start when none is)."""
        k = start
        while k < len(ids) and len(self.detok.text(ids[:k + 1])) <= n_chars:
            k += 1
        return k
