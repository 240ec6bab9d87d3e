"""Generated ids as text, the way a stream needs it: Detokenizer (leading spaces kept by decoding after the
last prompt tokens, an incomplete UTF-8 character held back), StopWatcher (stop strings: the text ends just
before the first one, even inside a token; what may be shown before it is known) and stream_text (a
generation's steps as (ids, text) pieces).

Does not know: models, the engine (StopWatcher is handed to Engine.generate as its should_stop callback),
what the text is shown on.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


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
    """Stop strings over the generated text (OpenAI's contract: the text ends just before the first occurrence of
    any stop string, wherever token boundaries fall). As Engine.generate's should_stop callback it returns the
    tokens to keep once a stop string shows up and no other one can still begin before it (one that later
    tokens may complete): the fewest whose text holds everything before it (the token the stop string begins in
    is kept for its text before it); `cut` is then that text's length. `shown` says how much of the text so far
    a stream may show: what no later token can turn into the start of a stop string."""

    def __init__(self, detok: Detokenizer, stops: Sequence[str]) -> None:
        self.detok, self.stops = detok, [s for s in stops if s]
        self.keep: int | None = None        # tokens kept, once the first stop string is known
        self.cut: int | None = None         # characters kept, once the first stop string is known

    def __call__(self, ids: list[int]) -> int | None:
        text = self.detok.stable_text(ids)            # (a trailing incomplete character is no text yet)
        cut = self.first(text)
        if cut is None or self._open(text) < cut:
            return None
        self.cut, self.keep = cut, self.tokens_holding(ids, cut)
        return self.keep

    def first(self, text: str) -> int | None:
        """Where the first stop string in `text` begins, or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _open(self, text: str) -> int:
        """Where the earliest stop string that later text could complete would begin (len(text) if none): the
        start of the longest end of `text` that is a proper beginning of some stop string."""
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return len(text) - hold

    def shown(self, text: str) -> int:
        """How many leading characters of `text` (the stable text so far) are final: up to the first stop string
        and to where one may still begin."""
        cut = self.cut if self.cut is not None else self.first(text)
        return min(self._open(text), len(text) if cut is None else cut)

    def tokens_within(self, ids: list[int], n_chars: int, start: int) -> int:
        """The largest k >= start with len(text(ids[:k])) <= n_chars (k = start when none is): a token ending
        in an incomplete character counts it."""
        k = start
        while k < len(ids) and len(self.detok.text(ids[:k + 1])) <= n_chars:
            k += 1
        return k

    def tokens_holding(self, ids: list[int], n_chars: int) -> int:
        """The fewest leading tokens whose stable text has at least n_chars characters (a binary search: the
        text of more tokens is never shorter)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.detok.stable_text(ids[:mid])) >= n_chars:
                hi = mid
            else:
                lo = mid + 1
        return lo


def stream_text(steps: Iterable[list[int]], detok: Detokenizer, watcher: StopWatcher | None
                ) -> Iterator[tuple[list[int], str]]:
    """(new ids, new text) from a generation's steps (Engine.generate, told `watcher` as its should_stop): the text
    as far as it is final (an incomplete character held back; with stop strings whatever could still begin one),
    ending just before the first stop string (also one the generation ended before it could stop at); the ids
    whose text was shown (the last kept one may hold the stop string's start). Nothing is yielded empty."""
    ids: list[int] = []
    emitted = shown = 0
    for new in steps:
        ids += new
        text = detok.stable_text(ids)
        end = watcher.shown(text) if watcher is not None else len(text)
        n = watcher.tokens_within(ids, end, emitted) if watcher is not None else len(ids)
        if end > shown or n > emitted:
            yield ids[emitted:n], text[shown:end]
            emitted, shown = n, max(shown, end)
    cut = None
    if watcher is not None:
        cut = watcher.cut if watcher.cut is not None else watcher.first(detok.text(ids))
        if cut is not None:
            ids = ids[:max(watcher.tokens_holding(ids, cut), emitted)]
    text = detok.text(ids)
    end = len(text) if cut is None else cut
    if end > shown or len(ids) > emitted:
        yield ids[emitted:], text[shown:end]
