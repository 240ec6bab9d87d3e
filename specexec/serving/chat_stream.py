"""The stream of a /v1/chat/completions or /v1/completions answer, from the worker's events
(specexec/serving/queue.py): OpenAI's chunks as server-sent events, ended by [DONE].

A chat stream opens with each choice's role chunk; every Delta is a chunk of new text (with its tokens'
log-probs when asked), every Finished a chunk with the finish reason and that choice's step statistics; a
failed generation an error body; with stream_options.include_usage the last chunk holds the usage. With tools,
text that may start a call is held back until it cannot (serving/tools.py ToolStream) and each call is sent
whole, as one tool_calls delta, when its choice ends.

Does not know: HTTP, request checks (specexec/serving/openai_api.py), how calls are parsed
(specexec/serving/tools.py).
"""
from __future__ import annotations

from typing import Any

from specexec.serving import openai_api as api
from specexec.serving import tools
from specexec.serving.queue import Delta, End, Failed, Finished


def apply(event: Any, choices: list[api.Choice]) -> None:
    """Fold a Delta or Finished event into its choice."""
    c = choices[event.index]
    if isinstance(event, Delta):
        c.text += event.text
        c.logprobs += event.logprobs
    elif isinstance(event, Finished):
        c.finish_reason, c.prompt_tokens, c.ids = event.finish_reason, event.prompt_tokens, event.ids
        c.completion_tokens, c.stats = event.completion_tokens, event.stats


def finish_choices(job: api.Job, choices: list[api.Choice], tokenizer) -> None:
    """A non-streamed tool job's choices split into content and tool_calls."""
    if job.tool_format is None:
        return
    for c in choices:
        split = tools.ToolStream(tools.by_name(job.tool_format))
        split.text = c.text
        c.text = tools.finish_calls(c, split, tokenizer)


class ChatStream:
    """One streamed chat or text completion: opening() -> the first frames, on(event, choices) -> the frames
    of one worker event, closing(end, choices) -> the last ones."""

    def __init__(self, job: api.Job, tokenizer) -> None:
        self.job, self.tokenizer = job, tokenizer
        self.splits = ([tools.ToolStream(tools.by_name(job.tool_format)) for _ in range(job.choices)]
                       if job.tool_format is not None else None)

    def opening(self) -> list[bytes]:
        if self.job.kind != "chat":
            return []
        return [api.sse(api.chunk(self.job, i, opening=True)) for i in range(self.job.choices)]

    def on(self, event: Delta | Finished | Failed, choices: list[api.Choice]) -> list[bytes]:
        if isinstance(event, Failed):
            return [api.sse(api.error_body(event.message, "server_error", code="generation_failed"))]
        apply(event, choices)
        if self.splits is None:
            return [api.sse(self._chunk(event))]
        return [api.sse(c) for c in self._tool_chunks(event, choices[event.index], self.splits[event.index])]

    def closing(self, end: End, choices: list[api.Choice]) -> list[bytes]:
        usage = [api.sse(api.usage_chunk(self.job, choices, end.queue_ms))] if self.job.include_usage else []
        return usage + [api.SSE_DONE]

    def _chunk(self, event: Delta | Finished) -> dict:
        """The chunk of a Delta (new text) or Finished (finish reason and that choice's step stats)."""
        if isinstance(event, Delta):
            return api.chunk(self.job, event.index, event.text, logprobs=event.logprobs)
        return api.chunk(self.job, event.index, None, event.finish_reason, event.stats)

    def _tool_chunks(self, event: Delta | Finished, c: api.Choice, split: tools.ToolStream) -> list[dict]:
        """A tool job's chunks for one event: content as far as no call can start, then at the end the rest,
        every tool call whole, and the finish chunk."""
        job = self.job
        if isinstance(event, Delta):
            new = split.feed(event.text)
            return [api.chunk(job, event.index, new, logprobs=event.logprobs)] if new else []
        rest = tools.finish_calls(c, split, self.tokenizer)
        out = [api.chunk(job, event.index, rest)] if rest else []
        if c.tool_calls:
            out.append(api.chunk(job, event.index, tool_calls=c.tool_calls))
        return out + [api.chunk(job, event.index, None, c.finish_reason, event.stats)]
