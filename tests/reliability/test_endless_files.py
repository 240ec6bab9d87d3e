"""A name that points at something with no end, through the real readers: /dev/zero, a FIFO no one writes and a
symlink to either as --prompt-file, a /load file or a config.json each end at once in ONE line, exit 2 (a
prompt file of /dev/zero had read until memory ran out, 'internal error MemoryError' under a 4 GB limit, and a
FIFO had waited forever; a config.json that is one is no config); input past the bound (a file or a stream) is one line naming the bound."""
from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from offload.formats.bounded_read import read_bytes, read_stream
from offload.formats.json_files import read_json
from specexec.options import ConfigError
from tests.reliability.checks import assert_one_line_error, copy_checkpoint

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not Path("/dev/zero").exists() or not hasattr(os, "mkfifo"), reason="POSIX only")]


@pytest.fixture(params=["device", "fifo", "symlink to a device"])
def endless(request, tmp_path: Path) -> Path:
    if request.param == "device":
        return Path("/dev/zero")
    if request.param == "fifo":
        os.mkfifo(tmp_path / "fifo")
        return tmp_path / "fifo"
    (tmp_path / "link").symlink_to("/dev/zero")
    return tmp_path / "link"


def test_a_prompt_file_with_no_end(cli, cache_root, tiny_llama, endless) -> None:
    t0 = time.monotonic()
    assert_one_line_error(cli("generate", "--model", tiny_llama, "--no-draft", "--prompt-file", endless,
                              "--cache-dir", cache_root), f"--prompt-file {endless} is not a regular file")
    assert time.monotonic() - t0 < 10


def test_a_conversation_to_load_with_no_end(endless) -> None:
    from cli.chat import read_conversation

    with pytest.raises(ConfigError, match="is not a regular file"):
        read_conversation(endless)


def test_a_config_with_no_end(cli, cache_root, tiny_llama, tmp_path, endless) -> None:
    model = copy_checkpoint(tiny_llama, tmp_path / "m")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(endless)
    assert_one_line_error(cli("generate", "--model", model, "--no-draft", "--prompt", "x", "--cache-dir",
                              cache_root), "config.json")
    with pytest.raises(ValueError, match="config.json is not a regular file"):
        read_json(model / "config.json")


def test_input_past_the_bound_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "big.json").write_text("[" + "0," * 600 + "0]")
    with pytest.raises(ValueError, match=r"big.json is larger than 0.00\d+ MiB"):
        read_json(tmp_path / "big.json", limit=1024)
    assert read_json(tmp_path / "big.json", limit=2048) == [0] * 601
    assert read_bytes(tmp_path / "big.json", "f", limit=1203) == (tmp_path / "big.json").read_bytes()
    with pytest.raises(ConfigError, match="the prompt on stdin is larger than"):
        read_stream(io.BytesIO(b"y\n" * 600), "the prompt on stdin", ConfigError, limit=1199)
    assert read_stream(io.BytesIO(b"y\n" * 600), "s", limit=1200) == b"y\n" * 600


def test_missing_files_and_directories_keep_their_own_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "absent", "f")
    with pytest.raises(IsADirectoryError):
        read_bytes(tmp_path, "f")
