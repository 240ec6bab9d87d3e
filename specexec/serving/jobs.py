"""A request's body -> the Job the queue runs (`JobMaker`): its options checked, its prompt rendered through the
chat template and tokenized, its grammar (a forced tool call's, which wins over response_format's; else
response_format's), and whether the run can take it (`admit`: the choices it asks for, its sampling and
acceptance against the run's rules), every refusal an ApiError naming the request's parameter.

Does not know: HTTP (cli/serve/app.py reads bodies and writes responses; it runs `chat` and `completion` off its
event loop, as they tokenize, and their grammars, `grammar_for`, on threads of their own), the queue, the wire shapes of answers (openai_api.py, responses.py, ...).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specexec.options import ConfigError
from specexec.serving import messages as chat_messages
from specexec.serving import openai_api as api
from specexec.serving import structured, tools


class JobMaker:
    """Jobs for one run: `runtime` gives the tokenizer, the grammars, the context and the engine's rule check;
    `defaults` the server's; `vocab_size` the target's."""

    def __init__(self, runtime: Any, defaults: api.ServerDefaults, vocab_size: int) -> None:
        self.runtime, self.defaults, self.vocab_size = runtime, defaults, vocab_size

    def chat(self, body: dict, with_grammar: bool = True) -> api.Job:
        """A chat body checked, rendered through the chat template and tokenized, with its grammar (unless
        with_grammar is False: a server compiles it apart, grammar_for)."""
        options = api.parse_options(body, self.defaults, self.vocab_size)
        tok = self.runtime.tokenizer
        given = tools.parse_tools(body)                  # rendered even with "none": the model sees its tools
        wanted = given if given is not None and given.choice != "none" else None
        fmt = tools.require_format(getattr(tok, "chat_template", None)) if wanted else None
        messages = chat_messages.parse_messages(body)
        ids = chat_messages.encode_chat(tok, messages, given and list(given.tools))
        return api.make_job("chat", options, [ids], self.defaults, self.runtime.context,
                            grammar=self._grammar(body, wanted, fmt) if with_grammar else None,
                            tool_format=fmt.name if fmt else None)

    def completion(self, body: dict, with_grammar: bool = True) -> api.Job:
        """A completions body checked, its prompts tokenized (echoed text kept when asked), with
        response_format's grammar (unless with_grammar is False: grammar_for)."""
        options = api.parse_options(body, self.defaults, self.vocab_size)
        if body.get("tools"):
            raise api.ApiError("'tools' needs /v1/chat/completions", param="tools", code="unsupported_parameter")
        prompts = api.parse_prompts(body, self.vocab_size)
        tok = self.runtime.tokenizer
        ids = [api.encode_text(tok, p) for p in prompts]
        texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if options.echo else []
        grammar = structured.response_grammar(body, self.runtime.grammars) if with_grammar else None
        return api.make_job("text", options, ids, self.defaults, self.runtime.context, texts, grammar)

    def grammar_for(self, body: dict) -> tuple[Callable[[], str | None], str] | None:
        """What compiling a (checked) body's grammar takes, to run where the caller likes (a server: on threads
        of its own, never the tokenizing one), and the parameter its refusal names; None: free text. Cheap."""
        given = tools.parse_tools(body) if body.get("tools") else None
        if given is not None and given.forced:
            fmt = tools.require_format(getattr(self.runtime.tokenizer, "chat_template", None))
            return (lambda: self._grammar(body, given, fmt)), "tools"
        if structured.response_schema(body)[0]:
            return (lambda: structured.response_grammar(body, self.runtime.grammars)), "response_format"
        return None

    def count_tokens(self, chat: dict) -> int:
        """The tokens of a chat body's prompt as the model's chat template renders it (its tools included)."""
        given = tools.parse_tools(chat)
        messages = chat_messages.parse_messages(chat)
        return len(chat_messages.encode_chat(self.runtime.tokenizer, messages, given and list(given.tools)))

    def admit(self, job: api.Job, max_choices: int) -> None:
        """ApiError unless the run takes `job`: at most max_choices choices (n x prompts), and its sampling and
        acceptance run here (the engine's rule: e.g. a verifier not exact at T > 0 names "temperature", what
        --accept cannot run on names "accept", by the refusal's subject)."""
        if job.choices > max_choices:
            raise api.ApiError(f"this request asks for {len(job.prompts)} prompt(s) x n {job.n} = {job.choices} "
                               f"choices; this server takes at most {max_choices} per request "
                               "(specexec serve --max-choices)", param="n", code="too_many_choices")
        try:
            self.runtime.engine.rule_for(job.sampling, job.accept)
        except ConfigError as e:
            param = "accept" if e.subject == "--accept" else "temperature"
            raise api.ApiError(str(e), param=param, code="invalid_value") from None

    def _grammar(self, body: dict, wanted: tools.ToolRequest | None, fmt: tools.ToolFormat | None) -> str | None:
        """A forced tool call's grammar, else response_format's (checked; a 400 when llguidance refuses it)."""
        grammars = self.runtime.grammars
        if wanted is None or not wanted.forced:
            return structured.response_grammar(body, grammars)
        try:
            grammar = grammars.lark(tools.forced_grammar(fmt, wanted, self.runtime.tokenizer))
            grammars.check(grammar)
        except ConfigError as e:
            raise api.ApiError(str(e), param="tools", code="invalid_value") from None
        return grammar
