"""Hostile prompts through the real command line: empty, too long, not UTF-8 (stdin bytes, argv bytes), full of
control characters, or made only of special tokens.

Decisions these tests pin down:
- an empty or whitespace-only prompt is an error (generating from BOS alone is never what was meant), wherever
  it comes from: --prompt, --prompt-file, stdin (`--prompt-file -`, or piped into `chat`);
- a prompt longer than the context is an error that says how many tokens fit; there is no truncation flag, so
  nothing is ever truncated silently;
- bytes that are not UTF-8 are an error naming the byte, whether they arrive on stdin or in argv (which Python
  hands over as lone surrogates);
- control characters (NUL, ANSI escapes) are ordinary prompt text: no crash, and never echoed raw into an
  error line or the status lines on stderr;
- special-token text ("<s></s><|user|>") is encoded as the tokenizer's special tokens (HF's default) and runs.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specexec.checkpoints.demo_models import CHAT_TOKENS, SPECIAL_TOKENS
from tests.reliability.checks import assert_nothing_cached, assert_one_line_error
from tests.tiny_models import VOCAB_SIZE

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
BAD_UTF8 = b"\xff\xfe bad \xc3\x28"               # invalid start bytes, then a broken 2-byte sequence
ESCAPES = "a\x00b\x1b[31mred\x1b[0m\x07\x1b]0;title\x07 done"


def _generate(cli, model: Path, *flags: str):
    return cli("generate", "--model", model, "--no-draft", "--max-new-tokens", "4", *flags)


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes, errors: str = "strict") -> None:
    """sys.stdin as a real process has it: a text wrapper over bytes (errors: 'strict' under a UTF-8 locale,
    'surrogateescape' under the C/POSIX locale)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors))


# ------------------------------------------------------------------------------------------ empty

@pytest.mark.parametrize("text", ["", "   ", "\n\t \n"])
def test_empty_prompt(text, cli, tiny_llama):
    assert_one_line_error(_generate(cli, tiny_llama, "--prompt", text), "--prompt is empty")


def test_empty_prompt_file_and_stdin(cli, tiny_llama, tmp_path, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert_one_line_error(_generate(cli, tiny_llama, "--prompt-file", empty), "empty.txt is empty")
    _stdin(monkeypatch, b"")
    assert_one_line_error(_generate(cli, tiny_llama, "--prompt-file", "-"), "stdin", "is empty")


def test_empty_stdin_to_chat(cli, tiny_llama, monkeypatch):
    _stdin(monkeypatch, b"  \n")
    assert_one_line_error(cli("chat", "--model", tiny_llama, "--no-draft"), "stdin is empty")


# ------------------------------------------------------------------------------------------ too long

def test_prompt_longer_than_the_context(cli, cache_root, tiny_llama, tmp_path):
    """The tiny models have 512 positions; ~900 tokens of prompt cannot fit, and nothing truncates it."""
    text = "the quick brown fox " * 225
    for source in (["--prompt", text], ["--prompt-file", tmp_path / "long.txt"]):
        (tmp_path / "long.txt").write_text(text)
        result = _generate(cli, tiny_llama, *source, "--cache-dir", cache_root)
        assert_one_line_error(result, "exceeds the model's context of 512 tokens", "at most 508 prompt tokens")
    assert_nothing_cached(cache_root)


def test_prompt_that_fits_exactly(cli, tiny_llama):
    """The boundary is inclusive: prompt + max_new_tokens == context runs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = tok("the quick brown fox " * 225)["input_ids"][:508]
    text = tok.decode(ids[1:])                         # without BOS: encoding adds it back
    assert len(tok(text)["input_ids"]) == 508
    result = _generate(cli, tiny_llama, "--prompt", text, "--json")
    assert result.code == 0, result.err
    assert 1 <= len(json.loads(result.out)["token_ids"]) <= 4


# ------------------------------------------------------------------------------------------ not UTF-8

@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_invalid_utf8_on_stdin(errors, cli, cache_root, tiny_llama, monkeypatch):
    _stdin(monkeypatch, BAD_UTF8, errors)
    result = _generate(cli, tiny_llama, "--prompt-file", "-", "--cache-dir", cache_root)
    assert_one_line_error(result, "stdin", "not UTF-8", "0xff at offset 0")
    assert_nothing_cached(cache_root)


def test_invalid_utf8_piped_into_chat(cli, tiny_llama, monkeypatch):
    _stdin(monkeypatch, b"hello " + BAD_UTF8)
    assert_one_line_error(cli("chat", "--model", tiny_llama, "--no-draft"), "stdin", "not UTF-8", "offset 6")


def test_invalid_utf8_in_a_prompt_file(cli, tiny_llama, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(BAD_UTF8)
    assert_one_line_error(_generate(cli, tiny_llama, "--prompt-file", bad), "bad.txt is not UTF-8")


def test_invalid_utf8_in_argv(cli, tiny_llama):
    """Python decodes argv bytes that are not UTF-8 to lone surrogates (PEP 383): they must not reach the
    tokenizer (which would fail deep inside with a UnicodeEncodeError)."""
    argv_text = BAD_UTF8.decode("utf-8", "surrogateescape")
    assert_one_line_error(_generate(cli, tiny_llama, "--prompt", argv_text), "--prompt is not valid UTF-8")
    assert_one_line_error(_generate(cli, tiny_llama, "--prompt", "x", "--chat", "--system", argv_text),
                          "--system is not valid UTF-8")


@pytest.mark.slow
def test_invalid_utf8_on_stdin_of_a_real_process(tiny_llama, tmp_path):
    """The whole way: a real `python -m cli.main` process with raw bytes on its stdin."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "SPECEXEC_CACHE": str(tmp_path / "cache"), "LC_ALL": "C.UTF-8"}
    proc = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--model", str(tiny_llama), "--no-draft",
                           "--prompt-file", "-"], input=BAD_UTF8, cwd=ROOT, env=env, capture_output=True,
                          timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b"", err
    assert err.count("\n") == 1 and err.startswith("error: ") and "not UTF-8" in err, err
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------------------ control characters

def _assert_no_raw_escapes(text: str) -> None:
    assert "\x1b" not in text and "\x00" not in text and "\x07" not in text, repr(text)


def test_control_characters_are_plain_text(cli, tiny_llama, tmp_path):
    result = _generate(cli, tiny_llama, "--prompt", ESCAPES, "--json")
    assert result.code == 0, result.err
    ids = json.loads(result.out)["token_ids"]                # valid JSON: the text field is escaped
    assert ids and all(0 <= t < VOCAB_SIZE for t in ids)
    _assert_no_raw_escapes(result.err)
    plain = _generate(cli, tiny_llama, "--prompt", ESCAPES)
    assert plain.code == 0, plain.err
    assert ESCAPES not in plain.out and "\x1b[31m" not in plain.out       # the prompt is never echoed
    _assert_no_raw_escapes(plain.err)
    (tmp_path / "p.txt").write_text(ESCAPES)
    assert _generate(cli, tiny_llama, "--prompt-file", tmp_path / "p.txt", "--chat").code == 0


def test_control_characters_in_error_lines_are_escaped(cli, tiny_llama, tmp_path):
    """A path with an ESC in it is shown escaped in the error line, never as a live terminal sequence."""
    for flags in (["--model", tmp_path / "\x1b[2Jgone", "--prompt", "x"],
                  ["--model", tiny_llama, "--prompt-file", tmp_path / "\x1b[31mred.txt"]):
        result = cli("generate", "--no-draft", *flags)
        line = assert_one_line_error(result)           # asserts no control character in the line
        assert "\\x1b" in line, line


def test_nul_in_a_path_is_a_user_error(cli, tiny_llama, tmp_path):
    """Only reachable in-process (argv cannot hold NUL), but it must still not be an 'internal error'."""
    result = cli("generate", "--no-draft", "--model", tiny_llama, "--prompt-file", f"{tmp_path}/a\x00b")
    assert_one_line_error(result, "--prompt-file")


# ------------------------------------------------------------------------------------------ special tokens

@pytest.mark.parametrize("chat", [False, True])
def test_prompt_made_of_special_tokens(chat, cli, tiny_llama):
    text = "".join(SPECIAL_TOKENS + CHAT_TOKENS)              # <unk><s></s><pad><|system|><|user|><|assistant|>
    result = _generate(cli, tiny_llama, "--prompt", text, "--json", *(["--chat"] if chat else []))
    assert result.code == 0, result.err
    ids = json.loads(result.out)["token_ids"]
    assert all(0 <= t < VOCAB_SIZE for t in ids)


def test_prompt_that_is_only_eos(cli, tiny_llama):
    result = _generate(cli, tiny_llama, "--prompt", "</s>", "--json")
    assert result.code == 0, result.err
    assert len(json.loads(result.out)["token_ids"]) <= 4
