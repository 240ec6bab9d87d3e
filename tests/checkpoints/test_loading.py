"""specexec.checkpoints.loading on real (tiny) HF checkpoints: logits equal transformers', pickle weights are never
unpickled by default (and never executed even when allowed), and every broken checkpoint fails with one
clear CheckpointError / ConfigError instead of a traceback from deep inside torch or safetensors."""
from __future__ import annotations

import builtins
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.formats.checkpoint import CheckpointError
from specexec.options import ConfigError
from specexec.checkpoints.loading import load_model, resolve_model_path


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _rewrite(path: Path, change) -> None:
    """Load model.safetensors, let `change(tensors)` edit the dict, write it back."""
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------ correctness

def test_load_model_matches_transformers_logits(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    ours = load_model(tiny_model, "cpu", "float32")
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    tokens = torch.randint(7, ours.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).expand(2, -1)
    with torch.no_grad():
        got = ours.logits(ours(tokens, positions)).view(2, 24, -1)
        want = ref(tokens).logits.float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in ours.parameters())


def test_every_loaded_weight_sits_64_byte_aligned_as_a_streamed_one_does(tiny_minimax_m2: Path) -> None:
    """A safetensors tensor read as stored is a view of the file's map at its header's offset; a BLAS GEMV's
    rounding follows its weight's address (MKL's SSE/AVX2 paths, an AMD CPU's), so resident weights are copied
    to 64-byte-aligned memory like a streamed layer's slot (offload.formats.refs.aligned): the two then compute
    alike on any CPU (issue 55: the expert-cache bit-for-bit tests failed on an AMD EPYC)."""
    from offload.formats.refs import WEIGHT_ALIGN
    from specexec.checkpoints.loading import read_args
    from specexec.checkpoints.naming import read_resident

    model = load_model(tiny_minimax_m2, "cpu", "float32")
    odd = [n for n, t in model.state_dict().items() if t.data_ptr() % WEIGHT_ALIGN]
    assert not odd, odd[:3]
    resident = read_resident(tiny_minimax_m2, read_args(tiny_minimax_m2), torch.float32, torch.device("cpu"))
    assert all(t.data_ptr() % WEIGHT_ALIGN == 0 for t in resident.values())


def test_aligned_copies_only_what_is_not() -> None:
    from offload.formats.refs import aligned

    buf = torch.arange(40, dtype=torch.float32)
    view = buf[1:33].view(4, 8)                              # 4 bytes past the allocator's 64-byte boundary
    out = aligned(view)
    assert out.data_ptr() % 64 == 0 and torch.equal(out, view) and out.data_ptr() != view.data_ptr()
    assert aligned(buf) is buf
    t = torch.arange(12.0).view(3, 4).t()                    # not contiguous: a contiguous copy
    assert aligned(t).is_contiguous() and torch.equal(aligned(t), t)


def test_dtype_is_applied(tiny_llama: Path) -> None:
    model = load_model(tiny_llama, "cpu", "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------ pickle

class _Evil:
    """Unpickling this creates `marker` (through builtins.open): proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def _pickle_checkpoint(tiny: Path, dest: Path, payload: dict) -> Path:
    dest.mkdir()
    shutil.copy(tiny / "config.json", dest / "config.json")
    torch.save(payload, dest / "pytorch_model.bin")
    return dest


def test_pickle_checkpoint_is_refused_and_never_unpickled(tiny_llama: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    path = _pickle_checkpoint(tiny_llama, tmp_path / "ckpt", {"model.embed_tokens.weight": _Evil(marker)})
    with pytest.raises(CheckpointError, match="pickle.*--allow-pickle") as info:
        load_model(path)
    assert "\n" not in str(info.value)
    assert not marker.exists()


def test_allowed_pickle_is_read_weights_only(tiny_llama: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    path = _pickle_checkpoint(tiny_llama, tmp_path / "ckpt", {"model.embed_tokens.weight": _Evil(marker)})
    with pytest.raises(CheckpointError, match="plain tensors.*(?i:weights.only|unsupported global)"):
        load_model(path, allow_pickle=True)
    assert not marker.exists()
    torch.load(path / "pytorch_model.bin", weights_only=False)        # the control: the payload is live
    assert marker.exists()


def test_allowed_plain_pickle_loads_the_same_weights(tiny_llama: Path, tmp_path: Path) -> None:
    path = _pickle_checkpoint(tiny_llama, tmp_path / "ckpt", load_file(tiny_llama / "model.safetensors"))
    a, b = load_model(tiny_llama), load_model(path, allow_pickle=True)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


# ------------------------------------------------------------------------------------------ broken safetensors

def test_truncated_safetensors(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(path)


def test_corrupted_header(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:24] = b"this is not json"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


def test_missing_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(path)


def test_extra_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    _rewrite(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(path)


def test_wrong_shape(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    _rewrite(path, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[63\].*\[64\]"):
        load_model(path)


def test_index_names_a_missing_shard(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    names = list(load_file(path / "model.safetensors"))
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which is missing"):
        load_model(path)


# ------------------------------------------------------------------------------------------ paths and configs

def test_hub_id_not_in_cache_names_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache.*--model /path/to/no-such-model"):
        resolve_model_path("no-such-org/no-such-model")


def test_missing_directory_and_file_instead_of_directory(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="is a file; pass the checkpoint directory"):
        resolve_model_path(str(tiny_llama / "config.json"))


def test_unsupported_architecture(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture GPT2LMHeadModel"):
        load_model(path)


def test_missing_or_invalid_config(tiny_llama: Path, tmp_path: Path) -> None:
    path = _copy(tiny_llama, tmp_path / "ckpt")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(path)


# ------------------------------------------------------------------------------------------ start-up

def test_on_meta_builds_without_init_and_restores_it() -> None:
    from torch import nn

    from specexec.network.model import on_meta

    calls = []
    saved = nn.init.normal_
    nn.init.normal_ = lambda t, *a, **k: calls.append(t) or t         # noqa: E731 -- counts init calls
    try:
        with on_meta():
            emb = nn.Embedding(10, 4)
        assert emb.weight.device.type == "meta" and calls == []
        nn.Embedding(10, 4)                                             # outside: initialised as usual
        assert len(calls) == 1
    finally:
        nn.init.normal_ = saved


def test_loading_a_model_does_not_import_torch_dynamo(tiny_llama: Path) -> None:
    """Initialising meta tensors runs torch's Python reference kernels, whose first use imports torch._dynamo
    (seconds of start-up for every command); loading builds its modules without init, so it never does."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from specexec.checkpoints.loading import load_model; "
            f"load_model(Path({str(tiny_llama)!r})); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_tokenizer_is_autotokenizers_own_without_the_model_config_class(tiny_model: Path) -> None:
    """load_tokenizer hands AutoTokenizer the model type instead of letting AutoConfig import the model's config
    class; the tokenizer must be the one AutoTokenizer builds on its own: class, ids, specials, chat template."""
    from transformers import AutoTokenizer

    from specexec.runtime.tokenizer import load_tokenizer

    ours, ref = load_tokenizer(tiny_model), AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    texts = ["Hello world", "def f(x):\n    return x**2  # ünïcödé 你好", "a  b\tc\n\nd"]
    assert type(ours) is type(ref) and [ours(t)["input_ids"] for t in texts] == [ref(t)["input_ids"] for t in texts]
    assert (ours.all_special_ids, ours.chat_template, ours.init_kwargs, len(ours)) == \
        (ref.all_special_ids, ref.chat_template, ref.init_kwargs, len(ref))


@pytest.mark.slow          # a fresh interpreter importing transformers (~25 s on 2 busy cores)
def test_loading_a_tokenizer_does_not_import_the_model_loading_machinery(tiny_llama: Path) -> None:
    """AutoConfig would import the model's config class and with it transformers.core_model_loading (and
    torch.distributed.tensor): seconds of every command's start, for a tokenizer that needs none of it."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from specexec.runtime.tokenizer import load_tokenizer; "
            f"load_tokenizer(Path({str(tiny_llama)!r})); print('transformers.core_model_loading' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False" and out.stderr == ""
