"""Token log-probabilities in the OpenAI wire shapes: the engine's TokenLogprob records (the target's processed
distribution where each token was chosen, specexec/generation.py) -> a chat `logprobs.content` entry per token
(token text, its UTF-8 bytes, logprob, top_logprobs) or the legacy /v1/completions object (tokens,
token_logprobs, top_logprobs as {token: logprob}, text_offset).

A token's text is its own decode; its bytes are the byte-level BPE bytes when the tokenizer has them (a piece of
a multi-byte character has no text of its own), else the UTF-8 of its text. A log-prob of -inf (a token the
processing rules out: top-k, top-p, a grammar) is sent as -9999.0, as JSON has no infinity.

Does not know: HTTP, how log-probs are computed, request parsing (specexec/serving/openai_api.py).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from specexec.generation import TokenLogprob

FLOOR = -9999.0                 # what -inf is sent as
MAX_TOP_CHAT = 20               # top_logprobs of /v1/chat/completions
MAX_TOP_TEXT = 5                # logprobs of /v1/completions


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable stand-in of each byte -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_piece(tokenizer, token: int) -> tuple[str, list[int]]:
    """(text, bytes) of one token id."""
    text = tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    raw = tokenizer.convert_ids_to_tokens(token)
    table = _byte_decoder()
    if isinstance(raw, str) and raw and all(c in table for c in raw) and text != raw:
        return text, [table[c] for c in raw]
    return text, list(text.encode("utf-8"))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def entries(tokenizer, records: Sequence[TokenLogprob]) -> list[dict]:
    """Chat `logprobs.content` entries: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
    out = []
    for r in records:
        text, raw = token_piece(tokenizer, r.token)
        top = []
        for t, lp in r.top:
            t_text, t_raw = token_piece(tokenizer, t)
            top.append({"token": t_text, "logprob": _finite(lp), "bytes": t_raw})
        out.append({"token": text, "logprob": _finite(r.logprob), "bytes": raw, "top_logprobs": top})
    return out


def chat_logprobs(items: Sequence[dict]) -> dict:
    """A chat choice's (or chunk's) `logprobs` object."""
    return {"content": list(items), "refusal": None}


def text_logprobs(items: Sequence[dict], offset: int = 0) -> dict:
    """/v1/completions' legacy `logprobs` object; text_offset counts characters from `offset`."""
    offsets, at = [], offset
    for e in items:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in items], "token_logprobs": [e["logprob"] for e in items],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in items],
            "text_offset": offsets}
