"""The Anthropic Messages API's server-sent events for one streamed answer, from the worker's events
(specexec/serving/queue.py): each is `event: TYPE` + `data: {...}`, and the stream ends with message_stop.

Order: message_start (the message with empty content and the prompt's usage), ping; for content,
content_block_start (a text block), content_block_delta (text_delta) as the text comes, content_block_stop; for
each tool call, content_block_start (a tool_use block with an empty input), one content_block_delta
(input_json_delta: the call's arguments whole; the model's call is parsed whole, in its own format),
content_block_stop; then message_delta (stop_reason, stop_sequence, cumulative usage: input, cache read and
output tokens) and message_stop. A failed generation: an `error` event (api_error) and nothing after it. With
tools, text that may start a call is held back until it cannot (serving/tools.py ToolStream).

Does not know: HTTP, the request's checks (specexec/serving/anthropic_api.py), how calls are parsed
(specexec/serving/tools.py).
"""
from __future__ import annotations

import json
from typing import Any

from specexec.serving import anthropic_api as anth
from specexec.serving import openai_api as api
from specexec.serving import tools
from specexec.serving.chat_stream import apply
from specexec.serving.queue import Delta, End, Failed, Finished


def event(kind: str, **fields: Any) -> bytes:
    """One server-sent event of type `kind` whose data is {"type": kind, **fields}."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n".encode()


class MessagesStream:
    """One streamed Messages answer: opening() -> the first events, on(event, choices) -> the events of one
    worker event, closing(end, choices) -> the last ones. Each returns encoded SSE frames."""

    def __init__(self, req: anth.MessagesRequest, job: api.Job, tokenizer) -> None:
        self.req, self.job, self.tokenizer = req, job, tokenizer
        self.split = tools.ToolStream(tools.by_name(job.tool_format)) if job.tool_format else None
        self.blocks = 0                    # content blocks started
        self.text_open = False
        self.failed = False

    def opening(self) -> list[bytes]:
        return [event("message_start", message=anth.message_object(self.job, [])), event("ping")]

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = []
        if not self.text_open:
            out.append(event("content_block_start", index=self.blocks, content_block={"type": "text", "text": ""}))
            self.text_open = True
        return out + [event("content_block_delta", index=self.blocks, delta={"type": "text_delta", "text": text})]

    def _close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        self.blocks += 1
        return [event("content_block_stop", index=self.blocks - 1)]

    def _tool_use(self, call: dict) -> list[bytes]:
        block, index = anth.tool_use_block(call), self.blocks
        self.blocks += 1
        partial = json.dumps(block["input"], ensure_ascii=False)
        return [event("content_block_start", index=index, content_block={**block, "input": {}}),
                event("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": partial}),
                event("content_block_stop", index=index)]

    def on(self, ev: Delta | Finished | Failed, choices: list[api.Choice]) -> list[bytes]:
        if isinstance(ev, Failed):
            self.failed = True
            return [event("error", error={"type": "api_error", "message": ev.message})]
        apply(ev, choices)
        if isinstance(ev, Delta):
            return self._text(self.split.feed(ev.text) if self.split else ev.text)
        c = choices[ev.index]
        out = self._text(tools.finish_calls(c, self.split, self.tokenizer)) if self.split is not None else []
        if self.blocks == 0 and not self.text_open and not c.tool_calls:    # an empty answer: one empty block
            out.append(event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
            self.text_open = True
        out += self._close_text()
        for call in c.tool_calls:
            out += self._tool_use(call)
        return out

    def closing(self, end: End, choices: list[api.Choice]) -> list[bytes]:
        if self.failed:
            return []
        c = choices[0]
        stop = anth.stop_met(c, self.job.prompts[0], self.req.stop_sequences, self.tokenizer)
        return [event("message_delta", delta={"stop_reason": anth.stop_reason(c, stop), "stop_sequence": stop},
                      usage=anth.usage(self.job, c)),
                event("message_stop")]
