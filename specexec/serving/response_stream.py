"""The Responses API's server-sent events for one streamed answer, from the worker's events
(specexec/serving/queue.py): each is `event: TYPE` + `data: {...}` with a `sequence_number` counting from 0,
and the stream ends with its last event (no [DONE]).

Order: response.created, response.in_progress; for content, response.output_item.added (a message),
response.content_part.added (an output_text part), response.output_text.delta as the text comes (with its
tokens' log-probs when asked), then response.output_text.done, response.content_part.done,
response.output_item.done; for each tool call, response.output_item.added (a function_call with empty
arguments), response.function_call_arguments.delta, response.function_call_arguments.done,
response.output_item.done; last response.completed (or response.incomplete at max_output_tokens) with the
whole response object. A failed generation: an `error` event, then response.failed. With tools, text that may
start a call is held back until it cannot (serving/tools.py ToolStream), and a call is sent when the answer
ends, its arguments in one delta (the model's call is parsed whole, in its own format).

Does not know: HTTP, the request's checks (specexec/serving/responses.py), how calls are parsed
(specexec/serving/tools.py).
"""
from __future__ import annotations

import json
from typing import Any

from specexec.serving import openai_api as api
from specexec.serving import responses as rs
from specexec.serving import tools
from specexec.serving.chat_stream import apply
from specexec.serving.queue import Delta, End, Failed, Finished


class ResponseStream:
    """One streamed Responses answer: opening() -> the first events, on(event, choices) -> the events of one
    worker event, closing(end, choices) -> the last one. Each returns encoded SSE frames."""

    def __init__(self, req: rs.ResponseRequest, job: api.Job, tokenizer) -> None:
        self.req, self.job, self.tokenizer = req, job, tokenizer
        self.logprobs = job.logprobs is not None
        self.split = tools.ToolStream(tools.by_name(job.tool_format)) if job.tool_format else None
        self.seq = 0
        self.output: list[dict] = []            # finished output items, in order
        self.message: dict | None = None        # the open message item
        self.text, self.text_logprobs = "", []
        self.failed = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()

    def _response(self, status: str, choice: api.Choice | None = None, queue_ms: float | None = None,
                  error: dict | None = None) -> dict:
        return rs.response_object(self.req, self.job, list(self.output), status, choice, queue_ms, error)

    def opening(self) -> list[bytes]:
        head = self._response("in_progress")
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    # ---------------------------------------------------------------- content
    def _where(self) -> dict:
        return {"item_id": self.message["id"], "output_index": len(self.output), "content_index": 0}

    def _open_message(self) -> list[bytes]:
        self.message = rs.message_item(rs.new_id("msg"), "", None, "in_progress")
        self.message["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=len(self.output), item=self.message),
                self._event("response.content_part.added", part=part, **self._where())]

    def _text(self, text: str, logprobs: tuple[dict, ...]) -> list[bytes]:
        if not text:
            return []
        out = self._open_message() if self.message is None else []
        self.text += text
        entries = list(logprobs) if self.logprobs else []
        self.text_logprobs += entries
        return out + [self._event("response.output_text.delta", delta=text, logprobs=entries, **self._where())]

    def _close_message(self, status: str) -> list[bytes]:
        if self.message is None:
            return []
        where = self._where()
        item = rs.message_item(self.message["id"], self.text, self.text_logprobs if self.logprobs else None,
                               status)
        part = item["content"][0]
        out = [self._event("response.output_text.done", text=self.text, logprobs=part["logprobs"], **where),
               self._event("response.content_part.done", part=part, **where),
               self._event("response.output_item.done", output_index=where["output_index"], item=item)]
        self.output.append(item)
        self.message = None
        return out

    def _call(self, call: dict) -> list[bytes]:
        index, item = len(self.output), rs.call_item(rs.new_id("fc"), call)
        where = {"item_id": item["id"], "output_index": index}
        out = [self._event("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"}),
               self._event("response.function_call_arguments.delta", delta=item["arguments"], **where),
               self._event("response.function_call_arguments.done", arguments=item["arguments"], **where),
               self._event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        return out

    # ---------------------------------------------------------------- worker events
    def on(self, event: Delta | Finished | Failed, choices: list[api.Choice]) -> list[bytes]:
        if isinstance(event, Failed):
            self.failed = True
            error = {"code": "generation_failed", "message": event.message}
            return [self._event("error", code="generation_failed", message=event.message, param=None),
                    self._event("response.failed", response=self._response("failed", error=error))]
        apply(event, choices)
        c = choices[event.index]
        if isinstance(event, Delta):
            return self._text(self.split.feed(event.text) if self.split else event.text, event.logprobs)
        out = []
        if self.split is not None:
            out += self._text(tools.finish_calls(c, self.split, self.tokenizer), ())
        status = rs.status_of(c)
        if self.message is None and not c.tool_calls:       # an empty answer is still a message
            out += self._open_message()
        out += self._close_message(status)
        for call in c.tool_calls:
            out += self._call(call)
        return out

    def closing(self, end: End, choices: list[api.Choice]) -> list[bytes]:
        if self.failed:
            return []
        c = choices[0]
        status = rs.status_of(c)
        return [self._event(f"response.{status}", response=self._response(status, c, end.queue_ms))]
