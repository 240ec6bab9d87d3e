"""`specexec chat`: KV reuse across turns, the /commands, Ctrl-C keeping the session, dropping old turns, the
line reader; piped stdin printing only the answer (in-process and as a subprocess); and a real pseudo-terminal
session with SIGINT mid-answer."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.chat import ChatSession, repl
from cli.main import main
from cli.terminal_input import read_message
from specexec.config import EngineConfig, SamplingParams
from specexec.runtime.assembly import Runtime
from specexec.runtime.tokenizer import encode_messages
from tests.cli.screen import Screen

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
       "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "160"}


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=8, dtype="float32"))


def _session(runtime: Runtime, max_new: int = 12, system: str | None = None) -> tuple[ChatSession, Screen]:
    runtime.engine.reset()
    screen = Screen()
    return ChatSession(runtime, SamplingParams(), system, screen.console, screen.write, max_new), screen


def test_second_turn_reuses_the_first_turns_cache(runtime) -> None:
    chat, screen = _session(runtime)
    first = chat.ask("Hello there")
    p1 = first.profile
    prompt1 = encode_messages(runtime.tokenizer, [{"role": "user", "content": "Hello there"}])
    assert p1["reused_tokens"] == 0 and p1["prompt_tokens"] == len(prompt1) - 1
    assert screen.answer_text == first.text + "\n" and first.ids and not first.interrupted
    second = chat.ask("Tell me more")
    prompt2 = encode_messages(runtime.tokenizer, chat.messages[:3])
    p2 = second.profile
    assert p2["reused_tokens"] >= len(prompt1) - 1                      # all of turn 1's prompt, at least
    assert p2["prompt_tokens"] == len(prompt2) - 1 - p2["reused_tokens"]  # only the rest is prefilled
    assert p2["prompt_tokens"] < len(prompt2) - 1
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2
    assert "tokens/pass" in screen.err.getvalue() and "reused" in screen.err.getvalue()


def test_reset_forgets_history_and_cache(runtime) -> None:
    chat, screen = _session(runtime)
    chat.ask("Hello there")
    assert chat.handle("/reset") is True
    assert chat.messages == [] and "cleared" in screen.err.getvalue()
    assert chat.ask("Hello there").profile["reused_tokens"] == 0


def test_set_changes_sampling_and_rejects_bad_values(runtime) -> None:
    chat, screen = _session(runtime)
    chat.handle("/set temperature 0.7")
    chat.handle("/set top-p 0.9")
    chat.handle("/set seed 5")
    chat.handle("/set max_new_tokens 7")
    assert (chat.sampling.temperature, chat.sampling.top_p, chat.sampling.seed) == (0.7, 0.9, 5)
    assert chat.max_new_tokens == 7
    for bad, needle in (("/set top_p 2", "top_p"), ("/set temperature hot", "temperature"),
                        ("/set colour red", "unknown setting"), ("/set budget 0", "budget"),
                        ("/set temperature", "needs a value"), ("/frobnicate", "unknown command")):
        before = (chat.sampling, chat.max_new_tokens)
        assert chat.handle(bad) is True                       # the session goes on
        assert needle in screen.err.getvalue().splitlines()[-1], bad
        assert (chat.sampling, chat.max_new_tokens) == before
    assert screen.err.getvalue().count("settable: ") == 1
    assert "frequency_penalty, logit_bias, max_new_tokens, budget" in screen.err.getvalue()   # every name /set takes
    chat.handle("/set budget 4")
    assert chat.runtime.config.budget == 4 and chat.runtime.engine.builder is not None
    chat.handle("/set")
    assert "budget 4" in screen.err.getvalue().splitlines()[-1]
    assert len(chat.ask("Hello").ids) <= 7


def test_save_and_load_round_trip(runtime, tmp_path) -> None:
    chat, _ = _session(runtime, system="Be brief.")
    chat.ask("Hello there")
    chat.ask("And then?")
    path = tmp_path / "chat.json"
    chat.handle(f"/save {path}")
    saved = json.loads(path.read_text())
    assert saved["messages"] == chat.messages and saved["system"] == "Be brief."
    follow_up = chat.ask("Why?").text

    other, screen = _session(runtime)
    other.handle(f"/load {path}")
    assert other.messages == saved["messages"] and other.system == "Be brief."
    assert other.ask("Why?").text == follow_up                     # same conversation, same greedy answer
    path.write_text('{"format": "specexec-chat", "messages": [{"role": "assistant", "content": "x"}]}')
    other.handle(f"/load {path}")
    assert "message 0" in screen.err.getvalue().splitlines()[-1]
    other.handle(f"/load {tmp_path / 'missing.json'}")
    assert "missing.json" in screen.err.getvalue().splitlines()[-1]


def test_retry_and_system(runtime) -> None:
    chat, screen = _session(runtime)
    chat.handle("/retry")
    assert "nothing to retry" in screen.err.getvalue()
    first = chat.ask("Hello there").text
    chat.handle("/retry")
    assert len(chat.messages) == 2 and chat.messages[1]["content"] == first        # T=0: the same answer
    assert chat.last.profile["reused_tokens"] > 0
    chat.handle("/system You are terse.")
    assert chat.system == "You are terse."
    chat.handle("/system -")
    assert chat.system is None
    chat.handle("/help")
    assert "/retry" in screen.err.getvalue()


def test_ctrl_c_keeps_the_shown_answer_and_the_session(runtime) -> None:
    chat, screen = _session(runtime, max_new=40)
    calls = []

    def write(text: str) -> None:
        calls.append(text)
        screen.write(text)
        if len(calls) == 2:
            raise KeyboardInterrupt                 # as if Ctrl-C arrived while the 2nd piece was shown

    chat.write = write
    answer = chat.ask("Hello there")
    assert answer.interrupted and answer.text == "".join(calls[:2])
    assert chat.messages[-1] == {"role": "assistant", "content": answer.text}
    assert "interrupted" in screen.err.getvalue()
    chat.write = screen.write
    after = chat.ask("Go on")
    assert not after.interrupted and after.profile["reused_tokens"] > 0


@pytest.mark.slow
def test_history_outgrowing_the_context_drops_the_oldest_turns(runtime) -> None:
    chat, screen = _session(runtime, max_new=60)
    for i in range(3):
        chat.ask(f"Message number {i}")
    chat.max_new_tokens = runtime.context - 40          # now only the newest message fits
    chat.ask("Last one")
    assert "dropped the 3 oldest turn(s)" in screen.err.getvalue()
    assert chat.messages[0]["content"] == "Last one" and len(chat.messages) == 2
    chat.max_new_tokens = runtime.context - 2
    chat.handle("/retry")                                    # too long even alone: an error, the session lives
    assert "exceeds the context" in screen.err.getvalue().splitlines()[-1]


def test_a_system_message_too_long_for_the_context_is_named(runtime) -> None:
    """The system message counts toward the context: when it is what does not fit, the line says so and how to
    replace it (it had said 'this message is N tokens' of a one-word message)."""
    chat, screen = _session(runtime, max_new=4, system="word " * runtime.context)
    assert chat.handle("hi") is True
    line = " ".join(screen.err.getvalue().split())                   # the screen wraps long lines
    assert "this message and the system message are" in line and "/system TEXT replaces it" in line, line
    chat.handle("/system -")
    assert chat.ask("hi").ids


def test_read_message_multiline() -> None:
    def reader(lines):
        it = iter(lines)

        def read(prompt: str) -> str:
            try:
                return next(it)
            except StopIteration:
                raise EOFError from None
        return read

    assert read_message(reader(["one \\", "two \\", "three"])) == "one \ntwo \nthree"
    assert read_message(reader(['"""', "a", "", "b", '"""'])) == "a\n\nb"
    assert read_message(reader([])) is None


def test_repl_runs_commands_until_end_of_input(runtime) -> None:
    chat, screen = _session(runtime, max_new=5)
    lines = iter(["Hello", "/stats", "//slash message", "/exit", "never read"])
    assert repl(chat, lambda _p: next(lines)) == 0
    assert next(lines) == "never read"
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["Hello", "/slash message"]
    assert "profile of the last answer" in screen.err.getvalue()
    lines = iter(["Hello"])

    def read(_p: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    assert repl(chat, read) == 0                                  # Ctrl-D ends the session


def test_piped_stdin_in_process(monkeypatch, capsys, tiny_pair, tiny_perturbed_draft) -> None:
    common = ["--model", str(tiny_pair[0]), "--max-new-tokens", "10", "--dtype", "float32"]
    assert main(["generate", *common, "--draft", str(tiny_perturbed_draft), "--chat", "--prompt", "Hello there",
                 "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))
    assert main(["chat", *common, "--draft", str(tiny_perturbed_draft)]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n" and captured.err == ""
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    assert main(["chat", *common, "--no-draft"]) == 2
    assert "stdin is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_piped_stdin_subprocess_prints_only_the_answer(tiny_pair, tiny_perturbed_draft, capsys) -> None:
    """`specexec chat < file` in a real process prints the answer alone, the text `generate --chat` gives."""
    argv = ["--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft), "--max-new-tokens", "8"]
    assert main(["generate", *argv, "--chat", "--prompt", "Line one\nLine two", "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["text"]
    chat = subprocess.run([sys.executable, "-m", "cli.main", "chat", *argv], input="Line one\nLine two\n", cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=240)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == want + "\n" and chat.stderr == ""


SLOW_CHAT = """
import sys, time
import specexec.decoding.engine as engine
step = engine.Engine._step
def slow(self, *a, **k):
    time.sleep(0.05)                      # make the answer last long enough to interrupt it mid-way
    return step(self, *a, **k)
engine.Engine._step = slow
from cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _answering(pexpect, target: Path, draft: Path, max_new: int):
    """A slowed `specexec chat` in a pseudo-terminal, its first answer started (to "Hello there")."""
    child = pexpect.spawn(sys.executable, ["-c", SLOW_CHAT, "chat", "--model", str(target), "--draft", str(draft),
                                           "--budget", "4", "--max-new-tokens", str(max_new)],
                          cwd=str(ROOT), env=ENV, encoding="utf-8", timeout=120, dimensions=(40, 160))
    try:
        child.expect_exact(">>> ")
        child.sendline("Hello there")
        child.expect_exact("Hello there\r\n")                  # the terminal's echo of the prompt line
        child.expect(r"[^\r\n]")                                # the first piece of the answer
    except BaseException:
        child.close(force=True)
        raise
    return child


def _leave(pexpect, child) -> None:
    """At the next prompt, /exit, and the session's end."""
    child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_returns_to_the_prompt(tiny_pair, tiny_perturbed_draft) -> None:
    pexpect = pytest.importorskip("pexpect")
    child = _answering(pexpect, tiny_pair[0], tiny_perturbed_draft, 400)
    try:
        child.sendintr()
        child.expect_exact("interrupted")
        child.expect_exact("tokens/pass")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect_exact("profile of the last answer")
        _leave(pexpect, child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


@pytest.mark.slow
def test_text_typed_during_an_answer_is_held_for_the_next_prompt(tiny_pair, tiny_perturbed_draft) -> None:
    """Typed while an answer streams: not echoed into the answer; the next prompt shows it and Enter sends it."""
    pexpect = pytest.importorskip("pexpect")
    child = _answering(pexpect, tiny_pair[0], tiny_perturbed_draft, 60)
    try:
        child.send("typed ahead")
        child.expect_exact("tokens/pass")                       # the answer's end (its stats line)
        answer = child.before
        child.expect_exact(">>> ")
        child.expect_exact("typed ahead")                       # held: the next prompt shows it
        assert "typed ahead" not in answer
        child.sendline("")
        child.expect_exact("tokens/pass")                       # and Enter sends it as the next message
        _leave(pexpect, child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_input_held_is_a_no_op_without_a_terminal(tmp_path) -> None:
    from cli.terminal_input import input_held

    with open(tmp_path / "f", "w") as f, input_held(f):
        f.write("x")
    with input_held(io.StringIO()):
        pass


def test_control_characters_of_a_model_reach_a_terminal_escaped(monkeypatch) -> None:
    """ESC, CR, BEL and the C1 controls would move the cursor, clear or recolour the screen: a terminal gets them
    escaped; newlines and tabs stay; a pipe or a file gets the text as it is."""
    from cli import generate

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    text = "a\x1b[2Jb\rc\td\ne\x07\x85é"
    monkeypatch.setattr(sys, "stdout", Terminal())
    generate.write_text(text)
    assert sys.stdout.getvalue() == "a\\x1b[2Jb\\rc\td\ne\\x07\\x85é"
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    generate.write_text(text)
    assert sys.stdout.getvalue() == text


def _bad_inputs(tmp_path):
    """What a user may type, paste or /load that is not a conversation: each must cost one line, not the session."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    surrogate = tmp_path / "surrogate.json"
    surrogate.write_text('{"format": "specexec-chat", "version": 1, "system": null, "messages": '
                         '[{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}')
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"format": "\xff\xfe"}')
    huge = tmp_path / "huge.json"
    huge.write_text('{"format": "specexec-chat", "version": ' + "9" * 5000 + "}")
    unwritable = tmp_path / "file"
    unwritable.write_text("x")
    return [("hi \udcff", "not valid UTF-8"), (UnicodeDecodeError("utf-8", b"hi \xff", 3, 4, "invalid"), "not UTF-8"),
            (f"/load {deep}", "nests"), (f"/load {surrogate}", "not valid Unicode"),
            (f"/load {binary}", "not UTF-8"), (f"/load {huge}", "not valid JSON"),
            (f"/load {tmp_path}", str(tmp_path)), (f"/save {unwritable}/chat.json", f"{unwritable}/chat.json"),
            ("/system \udcff", "not valid UTF-8")]


def test_nothing_typed_or_loaded_ends_a_session(runtime, tmp_path) -> None:
    """A stray byte typed or pasted, a /load of a deeply nested, non-Unicode, non-UTF-8 or oversized-number file, a
    /save where nothing can be written: one line each; the session reads on, and /exit still ends it."""
    chat, screen = _session(runtime, max_new=4)
    cases = _bad_inputs(tmp_path)
    feed = iter([c for c, _ in cases] + ["Hello", "/exit"])

    def read(_prompt: str) -> str:
        item = next(feed)
        if isinstance(item, BaseException):
            raise item
        return item

    assert repl(chat, read) == 0
    errors = [line for line in screen.err.getvalue().splitlines() if line.startswith("error: ")]
    assert len(errors) == len(cases), errors
    for (_, needle), line in zip(cases, errors):
        assert needle in line, (needle, line)
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["Hello"]


def test_text_typed_during_an_answer_survives_the_ctrl_c_that_stops_it() -> None:
    """input_held sets NOFLSH (a terminal flushes its input queue on the interrupt character otherwise) and
    clears ECHO while inside, and gives the terminal its modes back after."""
    pty = pytest.importorskip("pty")
    termios = pytest.importorskip("termios")
    from cli.terminal_input import input_held

    main_fd, child_fd = pty.openpty()
    try:
        with open(child_fd, "r", closefd=False) as stream:
            before = termios.tcgetattr(child_fd)
            with input_held(stream):
                held = termios.tcgetattr(child_fd)
                assert held[3] & termios.NOFLSH and not held[3] & termios.ECHO
            assert termios.tcgetattr(child_fd) == before
    finally:
        import os
        os.close(main_fd)
        os.close(child_fd)
