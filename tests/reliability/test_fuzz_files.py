"""A fuzz test per file format the loaders read: config.json, a safetensors header, a safetensors index, a GGUF
header, a chat template and a /load file. Each starts from a real file (the tiny checkpoint's), mutates it a
bounded number of times with a seeded generator (bytes flipped, cut, repeated; JSON values replaced by huge,
deep, non-finite, wrong-typed or non-Unicode ones) and reads the result with the loader: every case ends in a
value or ONE line of the format's error (ConfigError / CheckpointError / CacheError, one line), never a hang,
a crash, another exception or more than MEMORY bytes allocated while reading.

Bounded for CI: CASES inputs per format, each under SECONDS; the counts and times are printed (-s shows them).
"""
from __future__ import annotations

import json
import random
import shutil
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from offload.cache.manifest import CacheError
from offload.formats.checkpoint import CheckpointError, SafetensorsCheckpoint
from specexec.options import ConfigError

pytestmark = pytest.mark.timeout(300)

CASES = 60                       # mutated inputs per format
SECONDS = 5.0                    # at most, per input
MEMORY = 64 << 20                # bytes allocated (peak) while reading one input
ONE_LINE = (ConfigError, CheckpointError, CacheError)
ODD_VALUES = [10**5000 // 10**4000, -1, 0, 1e308, "NaN", True, None, [], {}, "x" * 5000, "\ud800",
              json.loads("[" * 600 + "]" * 600), {"a": {"b": {"c": None}}}, 4.5, "4", -1e-300]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One random damage to `data`: flipped bytes, a cut, a repeated chunk, inserted garbage or a big length."""
    b = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:
        del b[rng.randrange(len(b)):]
    elif kind == 2:
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        b[i:i] = b[i:j][:4096] * rng.randint(1, 4)
    elif kind == 3:
        i = rng.randrange(len(b))
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        i = rng.randrange(max(len(b) - 8, 1))
        b[i:i + 8] = rng.choice([2**63 - 1, 2**40, 0, 2**32 + 7]).to_bytes(8, "little")
    return bytes(b)


def mutate_json(value, rng: random.Random):
    """`value` with one nested value replaced by an odd one (or the whole thing, or a key added)."""
    if not isinstance(value, (dict, list)) or not value or rng.random() < 0.1:
        return rng.choice(ODD_VALUES)
    out = dict(value) if isinstance(value, dict) else list(value)
    key = rng.choice(list(out)) if isinstance(out, dict) else rng.randrange(len(out))
    if isinstance(out, dict) and rng.random() < 0.2:
        out[f"k{rng.randrange(99)}"] = rng.choice(ODD_VALUES)
    else:
        out[key] = mutate_json(out[key], rng)
    return out


def dump(value) -> bytes:
    return json.dumps(value, ensure_ascii=True).encode()          # lone surrogates written as \\ud800 escapes


def run_cases(name: str, make: Callable[[random.Random], None], read: Callable[[], object]) -> None:
    """CASES times: make an input, read it; the reading must end in a value or one line, within the bounds."""
    rng = random.Random(f"fuzz-{name}")
    outcomes = {"read": 0, "refused": 0}
    t0 = time.monotonic()
    for case in range(CASES):
        make(rng)
        tracemalloc.start()
        start = time.monotonic()
        try:
            read()
            outcomes["read"] += 1
        except ONE_LINE as e:
            assert "\n" not in str(e) and str(e), (name, case, str(e))
            outcomes["refused"] += 1
        except Exception as e:                      # noqa: BLE001 -- the finding
            pytest.fail(f"{name} case {case}: {type(e).__name__}: {e}")
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert time.monotonic() - start < SECONDS, (name, case)
        assert peak < MEMORY, (name, case, peak)
    print(f"fuzz {name}: {CASES} inputs, {outcomes['read']} read, {outcomes['refused']} refused in one line, "
          f"{time.monotonic() - t0:.1f} s")


def test_config_json(tiny_llama: Path, tmp_path: Path) -> None:
    from specexec.checkpoints.loading import read_args

    model = tmp_path / "m"
    model.mkdir()
    base = json.loads((tiny_llama / "config.json").read_text())

    def make(rng: random.Random) -> None:
        text = dump(mutate_json(base, rng))
        (model / "config.json").write_bytes(mutate_bytes(text, rng) if rng.random() < 0.3 else text)
    run_cases("config.json", make, lambda: read_args(model))


def test_safetensors_header(tiny_llama: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    weights = (tiny_llama / "model.safetensors").read_bytes()
    n = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + n])

    def make(rng: random.Random) -> None:
        if rng.random() < 0.5:
            new = dump(mutate_json(header, rng))
            data = len(new).to_bytes(8, "little") + new + weights[8 + n:]
        else:
            data = mutate_bytes(weights[:8 + n + 64], rng) + weights[8 + n + 64:]
        (model / "model.safetensors").write_bytes(data)

    def read() -> object:
        from offload.cache.identity import fingerprint

        fingerprint(model)
        return SafetensorsCheckpoint(model).names()
    run_cases("safetensors header", make, read)


def test_safetensors_index(tiny_llama: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    names = SafetensorsCheckpoint(model).names()
    index = {"metadata": {"total_size": 1}, "weight_map": {k: "model.safetensors" for k in names}}

    def make(rng: random.Random) -> None:
        text = dump(mutate_json(index, rng))
        (model / "model.safetensors.index.json").write_bytes(mutate_bytes(text, rng) if rng.random() < 0.3 else text)
    run_cases("safetensors index", make, lambda: SafetensorsCheckpoint(model).names())


def test_gguf_header(tiny_llama: Path, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from offload.formats.gguf import open_gguf
    from tests.offload.formats.gguf_writer import write_gguf

    good = write_gguf(tiny_llama, tmp_path / "good.gguf").read_bytes()
    path = tmp_path / "fuzz.gguf"

    def make(rng: random.Random) -> None:
        head = min(len(good), 4096)
        path.write_bytes(mutate_bytes(good[:head], rng) + good[head:])

    def read() -> object:
        from specexec.families import model_args

        return model_args(open_gguf(path).config())
    run_cases("GGUF header", make, read)


def test_chat_template(tiny_llama: Path) -> None:
    from specexec.runtime.tokenizer import encode_messages, load_tokenizer

    tok = load_tokenizer(tiny_llama)
    template = tok.chat_template
    messages = [{"role": "user", "content": "Hello"}]

    def make(rng: random.Random) -> None:
        text = mutate_bytes(template.encode(), rng).decode("utf-8", "replace")
        if rng.random() < 0.3:
            text += rng.choice(["{{ raise_exception('no') }}", "{{ messages.__class__.__mro__ }}",
                                "{% for x in range(10**9) %}{% endfor %}", "{{ 1 / 0 }}", "{{ messages[99] }}"])
        tok.chat_template = text
    run_cases("chat template", make, lambda: encode_messages(tok, messages))


def test_chat_load_file(tmp_path: Path) -> None:
    from cli.chat import SAVE_FORMAT, read_conversation

    path = tmp_path / "chat.json"
    saved = {"format": SAVE_FORMAT, "version": 1, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "sampling": {}}

    def make(rng: random.Random) -> None:
        text = dump(mutate_json(saved, rng))
        path.write_bytes(mutate_bytes(text, rng) if rng.random() < 0.3 else text)
    run_cases("/load file", make, lambda: read_conversation(path))


@pytest.mark.parametrize("tail", ["{{ raise_exception('no') }}", "{{ messages.__class__.__mro__[1].__subclasses__() }}",
                                  "{% for x in range(10**9) %}{% endfor %}", "{{ 1 / 0 }}", "{{ messages[99].x }}",
                                  "{{ messages | join(3) }}"])
def test_a_template_that_raises_is_one_line(tiny_llama: Path, tail: str) -> None:
    from specexec.runtime.tokenizer import encode_messages, load_tokenizer

    tok = load_tokenizer(tiny_llama)
    tok.chat_template = tok.chat_template + tail
    try:
        encode_messages(tok, [{"role": "user", "content": "Hello"}])
    except ConfigError as e:
        assert str(e).startswith("the model's chat template failed") and "\n" not in str(e)
