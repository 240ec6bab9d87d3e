"""Draft/target compatibility from the tokenizers alone, before any weight loads (specexec/runtime/tokenizer.py
check_compatible): the same tokenizer goes silently; a draft whose embedding table is padded to another size,
or whose vocabulary is a prefix of the target's, goes with one line that says so, and its logits are aligned to
the target's rows (specexec/runtime/draft_vocab.py) so greedy output still equals target-only decoding and the
sampling rules that compare q with p row for row run; anything else (another vocabulary, another EOS token) is
one line naming the first token that differs, before a weight is read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cli.main import main
from specexec.config import EngineConfig, SamplingParams
from specexec.options import ConfigError
from specexec.runtime.assembly import Runtime
from specexec.runtime.tokenizer import check_compatible, load_tokenizer
from tests.tiny_models import PREFIX_VOCAB_SIZE, VOCAB_SIZE, prompt, write_tiny_model

F32 = EngineConfig(budget=6, dtype="float32")


@pytest.fixture(scope="module")
def drafts(tiny_root: Path) -> dict[str, Path]:
    root = tiny_root / "pairs"
    return {"padded": write_tiny_model(root / "padded", "llama", seed=51, vocab_size=384),
            "prefix": write_tiny_model(root / "prefix", "llama", seed=52, tokenizer="prefix")}


def _check(target: Path, draft: Path) -> str | None:
    t, d = (json.loads((p / "config.json").read_text())["vocab_size"] for p in (target, draft))
    return check_compatible(load_tokenizer(target), load_tokenizer(draft), t, d)


def test_the_same_tokenizer_goes_silently(tiny_pair) -> None:
    assert _check(*tiny_pair) is None


def test_padded_and_prefix_drafts_go_and_say_so(tiny_pair, drafts) -> None:
    target = tiny_pair[0]
    assert _check(target, drafts["padded"]) == ("compatible tokenizers: the embedding tables are padded differently "
                                                f"(draft 384 rows, target {VOCAB_SIZE}): the draft proposes from the "
                                                f"first {VOCAB_SIZE}")
    note = _check(target, drafts["prefix"])
    assert note.startswith(f"compatible tokenizers: the draft's vocabulary is the first {PREFIX_VOCAB_SIZE} of "
                           f"the target's {VOCAB_SIZE} tokens")


def test_a_different_tokenizer_is_one_line_naming_the_first_token(tiny_pair, tiny_mismatched_draft,
                                                                  tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _check(tiny_pair[0], tiny_mismatched_draft)
    assert str(info.value).startswith("draft and target tokenizers disagree: id 0 is '<unk>' in the target, "
                                      "'</s>' in the draft") and "\n" not in str(info.value)
    other_eos = shutil.copytree(tiny_pair[1], tmp_path / "eos")        # same vocabulary, another EOS token
    cfg = json.loads((other_eos / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<pad>"
    (other_eos / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"disagree on the eos token: target '</s>', draft '<pad>'"):
        _check(tiny_pair[0], other_eos)


@pytest.mark.parametrize("kind", ["padded", "prefix"])
def test_aligned_drafts_keep_greedy_exact_and_sampling_running(tiny_pair, drafts, kind: str) -> None:
    rt = Runtime.load(str(tiny_pair[0]), str(drafts[kind]), F32)
    assert rt.pair_note and rt.engine.draft.logits(torch.zeros(1, 64)).shape == (1, VOCAB_SIZE)
    ids = prompt(5) + [VOCAB_SIZE - 1, VOCAB_SIZE - 2]                    # ids a prefix draft has no row for
    want = [t for s in rt.variant(F32, use_draft=False).generate_ids(ids, 16) for t in s]
    assert [t for s in rt.generate_ids(ids, 16) for t in s] == want
    rsd = rt.variant(F32.replace(builder="rsd"))                          # recursive rejection sampling: q vs p
    assert len([t for s in rsd.generate_ids(ids, 8, SamplingParams(temperature=1.0, seed=1)) for t in s]) > 0


def test_the_cli_prints_the_note_and_refuses_before_loading(tiny_pair, drafts, tiny_mismatched_draft,
                                                            capsys, monkeypatch) -> None:
    args = ["generate", "--model", str(tiny_pair[0]), "--prompt", "Hello", "--max-new-tokens", "3", "--dtype",
            "float32"]
    assert main(args + ["--draft", str(drafts["padded"])]) == 0
    assert "compatible tokenizers: the embedding tables are padded differently" in capsys.readouterr().err
    import specexec.runtime.assembly as assembly
    monkeypatch.setattr(assembly, "check_checkpoint", lambda *a, **k: pytest.fail("weights were looked at"))
    assert main(args + ["--draft", str(tiny_mismatched_draft)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: draft and target tokenizers disagree: id 0")


def test_a_text_longer_than_model_max_length_is_not_warned_about(tiny_pair) -> None:
    """transformers' own line about a sequence over model_max_length (chat printed it before its one line on the
    context) is not shown: the context is checked by the runtime."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        tok = load_tokenizer(tiny_pair[0])
        ids = tok.encode("hello " * (tok.model_max_length + 10))
    finally:
        logger.removeHandler(handler)
    assert len(ids) > tok.model_max_length
    assert not [r for r in records if "longer than the specified maximum" in r.getMessage()]


def test_a_vocabulary_too_small_for_its_tokenizer_says_how_many_rows_it_needs(tiny_pair) -> None:
    """Ids up to N need N + 1 rows: the line's numbers say what is wrong (issue 55: 'ids up to 373 but ... only
    373 rows')."""
    target, draft = tiny_pair
    tok = load_tokenizer(target)
    top = max(tok.get_vocab().values())
    with pytest.raises(ConfigError) as e:
        check_compatible(tok, load_tokenizer(draft), top, 10**6)
    msg = str(e.value)
    assert f"ids up to {top}, which need {top + 1} embedding rows" in msg and f"has {top} rows;" in msg, msg
