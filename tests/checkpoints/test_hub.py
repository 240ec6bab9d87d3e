"""Models by Hub name (specexec.checkpoints.hub, resolve_model_path, cli/fetch.py) against a local Hub stand-in on
127.0.0.1 (tests/checkpoints/hub_server.py, reached through HF_ENDPOINT): only what loads is fetched (never pickles), a dropped
connection resumes with a Range request, an interrupted process resumes from its .part file, a corrupted part
is caught by the checksum, 401/403/404 and offline-without-cache each end as one line (exit 2 from the CLI),
the free-disk check counts the layer cache the plan will build, and GGUF repos need --gguf-file."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli.main import main
from specexec.options import ConfigError
from specexec.checkpoints import hub as hub_mod
from specexec.config import EngineConfig, OffloadConfig
from specexec.planning.disk_need import layer_cache_bytes
from specexec.planning.sizes import layer_bytes
from specexec.checkpoints.hub import HubOptions, cached, fetch
from specexec.checkpoints.loading import load_model, read_args, resolve_model_path
from tests.checkpoints.hub_server import LocalHub, serve, stop

REPO = "tiny-org/tiny-llama"
JUNK = {"pytorch_model.bin": b"\x80\x02pickle" * 50, "README.md": b"# tiny\n", "original/consolidated.pth": b"p" * 99,
        "onnx/model.safetensors": b"o" * 64, ".gitattributes": b"*.safetensors filter=lfs\n"}
LOADED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "model.safetensors"}


def sharded(src: Path) -> dict[str, bytes]:
    """src's checkpoint split in two shards with an index, plus a stray consolidated file the index omits."""
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    out = {p.name: p.read_bytes() for p in src.iterdir() if p.name != "model.safetensors"}
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        shard = f"model-0000{k}-of-00002.safetensors"
        path = src.parent / f"{src.name}-{shard}"
        save_file({n: tensors[n].contiguous() for n in part}, str(path), metadata={"format": "pt"})
        out[shard] = path.read_bytes()
        weight_map.update({n: shard for n in part})
    out["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    out["consolidated.safetensors"] = (src / "model.safetensors").read_bytes()
    return out


@pytest.fixture(scope="module")
def local_hub(tiny_llama: Path, tmp_path_factory):
    hub = LocalHub()
    hub.add_dir(REPO, tiny_llama, extra=JUNK)
    hub.add_dir("tiny-org/gated", tiny_llama, access="gated")
    hub.add_dir("tiny-org/private", tiny_llama, access="private")
    copy = tmp_path_factory.mktemp("shards") / "src"
    copy.mkdir()
    for p in tiny_llama.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    hub.add("tiny-org/sharded", sharded(copy))
    hybrid = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "num_hidden_layers": 4,
              "mamba_d_state": 16}
    hub.add("tiny-org/hybrid", {"config.json": json.dumps(hybrid).encode(), "model.safetensors": b"w" * 5000})
    hub.add("tiny-org/gpt2", {"config.json": b'{"architectures": ["GPT2LMHeadModel"]}',
                              "model.safetensors": b"w" * 5000})
    hub.add("tiny-org/tiny-gguf", {"README.md": b"gguf", "tiny.Q4_0.gguf": b"GGUF" + b"q" * 1000,
                                   "tiny.Q8_0.gguf": b"GGUF" + b"8" * 2000})
    server, thread = serve(hub)
    yield hub
    stop(server, thread)


@pytest.fixture
def online(local_hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalHub:
    """The Hub stand-in as HF_ENDPOINT, an empty HF_HOME and layer cache, downloads on, no token."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", local_hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "layers"))
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE", "SPECEXEC_MODEL_DIRS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 32 << 10)      # progress and resume points per 32 KB
    local_hub.log.clear()
    return local_hub


def _files(snapshot: Path) -> set[str]:
    return {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ downloads

def test_fresh_download_fetches_only_what_loads_and_reports_progress(online: LocalHub, tiny_llama: Path) -> None:
    seen: list[tuple[int, int, str]] = []
    path = fetch(REPO, HubOptions(progress=lambda d, t, n: seen.append((d, t, n))))
    assert _files(path) == LOADED
    fetched = {r.path.rsplit("/", 1)[-1] for r in online.log if r.method == "GET" and "/resolve/" in r.path}
    assert fetched == LOADED - {"model.safetensors"}               # weights come through the /cdn/ redirect
    assert len(online.gets(online.by_sha("model.safetensors", REPO))) == 1
    assert not any(j in r.path for r in online.log for j in JUNK if r.method == "GET")
    for name in LOADED:
        assert (path / name).read_bytes() == (tiny_llama / name).read_bytes()
    total = sum((tiny_llama / n).stat().st_size for n in LOADED)
    assert seen[-1][:2] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    assert len({d for d, _, n in seen if n == "model.safetensors"}) > 3   # the bar moves during the big file
    model = load_model(resolve_model_path(REPO))                     # found offline now, and it loads
    assert torch.equal(model.embed_tokens.weight, load_model(tiny_llama).embed_tokens.weight)
    online.log.clear()
    assert fetch(REPO, HubOptions()) == path                         # all cached: no file is fetched again
    assert [r.method for r in online.log if r.method == "GET"] == ["GET"]          # the listing only


def test_sharded_repo_fetches_the_shards_its_index_names(online: LocalHub, tiny_llama: Path) -> None:
    path = fetch("tiny-org/sharded", HubOptions())
    assert "consolidated.safetensors" not in _files(path)
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= _files(path)
    assert torch.equal(load_model(path).lm_head.weight, load_model(tiny_llama).lm_head.weight)


def test_a_dropped_connection_resumes_with_a_range_request(online: LocalHub, tiny_llama: Path) -> None:
    sha = online.by_sha("model.safetensors", REPO)
    online.drop_after_half.add("model.safetensors")
    path = fetch(REPO, HubOptions())
    gets = online.gets(sha)
    assert len(gets) == 2 and gets[0].range is None
    start = int(gets[1].range.removeprefix("bytes=").removesuffix("-"))
    size = (tiny_llama / "model.safetensors").stat().st_size
    assert 0 < start <= size // 2
    assert _sha(path / "model.safetensors") == sha


def test_an_interrupted_run_resumes_from_its_part_file(online: LocalHub, tiny_llama: Path) -> None:
    size = (tiny_llama / "model.safetensors").stat().st_size
    sha = online.by_sha("model.safetensors", REPO)

    def ctrl_c(done: int, total: int, name: str) -> None:
        if name == "model.safetensors" and total - done < size // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch(REPO, HubOptions(progress=ctrl_c))
    part = hub_mod.storage_dir(REPO, HubOptions()) / "blobs" / (sha + hub_mod.PART)
    kept = part.stat().st_size
    assert 0 < kept < size
    assert cached(REPO, HubOptions()) is None                       # incomplete: not taken for a checkpoint
    with pytest.raises(ConfigError, match=r"incomplete .* lacks \*\.safetensors.*--offline"):
        resolve_model_path(REPO, HubOptions(offline=True))
    online.log.clear()
    path = fetch(REPO, HubOptions())
    assert [r.range for r in online.gets(sha)] == [f"bytes={kept}-"]
    assert _sha(path / "model.safetensors") == sha and not part.exists()


def test_a_corrupt_part_file_is_caught_by_the_checksum_and_removed(online: LocalHub) -> None:
    sha = online.by_sha("model.safetensors", REPO)
    part = hub_mod.storage_dir(REPO, HubOptions()) / "blobs" / (sha + hub_mod.PART)
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 1000)                                   # not the file's first 1000 bytes
    with pytest.raises(ConfigError, match="does not match its checksum"):
        fetch(REPO, HubOptions())
    assert not part.exists()
    assert _sha(fetch(REPO, HubOptions()) / "model.safetensors") == sha


def test_a_second_hub_name_resolves_after_a_tokenizer_loads(online: LocalHub) -> None:
    """Loading a tokenizer (offline by local_files_only) leaves the process online: the next Hub name in the
    same process (`bench --drafts A,ORG/NAME`, a server loading a second model) still downloads."""
    from specexec.runtime.tokenizer import load_tokenizer

    first = resolve_model_path(REPO, HubOptions())
    assert load_tokenizer(first).get_vocab()
    second = resolve_model_path("tiny-org/sharded", HubOptions())
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= _files(second)


# ------------------------------------------------------------------------------------------ access + offline

def test_gated_repo_needs_hf_token(online: LocalHub, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"access to tiny-org/gated denied \(HTTP 401\).*gated.*HF_TOKEN"):
        fetch("tiny-org/gated", HubOptions())
    monkeypatch.setenv("HF_TOKEN", "wrong-token")
    with pytest.raises(ConfigError, match=r"HTTP 403.*HF_TOKEN is set but its account has no access"):
        fetch("tiny-org/gated", HubOptions())
    monkeypatch.setenv("HF_TOKEN", "good-token")
    assert _files(fetch("tiny-org/gated", HubOptions())) == LOADED


def test_private_and_missing_repos_say_so(online: LocalHub) -> None:
    with pytest.raises(ConfigError, match=r"access to tiny-org/private denied \(HTTP 401\).*set HF_TOKEN"):
        fetch("tiny-org/private", HubOptions())
    with pytest.raises(ConfigError, match=r"no model tiny-org/nope on http://127\.0\.0\.1:\d+ \(HTTP 404\)"):
        fetch("tiny-org/nope", HubOptions())


@pytest.mark.parametrize("argv, env", [
    (["--model", "tiny-org/gated"], {}),
    (["--model", "tiny-org/nope"], {}),
    (["--model", REPO, "--offline"], {}),
    (["--model", REPO], {"HF_HUB_OFFLINE": "1"}),
])
def test_cli_failures_are_one_line_with_exit_2(online: LocalHub, capsys, monkeypatch, argv, env) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = main(["generate", *argv, "--no-draft", "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and err.startswith("error: ")
    assert ("HF_TOKEN" in err) or ("HTTP 404" in err) or ("downloads are off" in err and
                                                         ("--offline" in err or "HF_HUB_OFFLINE=1" in err))
    if "downloads are off" in err:
        assert not online.log                                       # offline: nothing was asked of the Hub


@pytest.mark.parametrize("repo, why", [("tiny-org/hybrid", "Mamba layers are a layer kind"), ("tiny-org/gpt2", "supported: Llama")])
def test_an_unsupported_architecture_is_refused_before_any_weight_is_fetched(online: LocalHub, capsys, repo: str,
                                                                              why: str) -> None:
    """config.json comes first; its one line (which architecture, not supported, for a hybrid why) ends the
    command before a byte of the weights is asked for."""
    code = main(["generate", "--model", repo, "--no-draft", "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()[-1]         # after the config.json download bar
    assert code == 2 and err.startswith("error: unsupported architecture") and why in err, err
    assert online.gets("config.json") and not online.gets(online.by_sha("model.safetensors", repo))
    assert not [r for r in online.log if "model.safetensors" in r.path and r.method == "GET"]


def test_offline_uses_the_cache_without_a_request(online: LocalHub, capsys) -> None:
    assert main(["generate", "--model", REPO, "--no-draft", "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    online.log.clear()
    capsys.readouterr()
    assert main(["generate", "--model", REPO, "--no-draft", "--prompt", "hi", "--max-new-tokens", "2",
                 "--offline", "--json"]) == 0
    assert not online.log
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2


# ------------------------------------------------------------------------------------------ gguf + disk

def test_gguf_repo_takes_one_named_file(online: LocalHub) -> None:
    with pytest.raises(ConfigError, match=r"GGUF files; pick one with --gguf-file NAME \(tiny.Q4_0.gguf, tiny.Q8"):
        fetch("tiny-org/tiny-gguf", HubOptions())
    with pytest.raises(ConfigError, match="has no file 'nope.gguf'; its .gguf files: tiny.Q4_0.gguf"):
        fetch("tiny-org/tiny-gguf", HubOptions(gguf_file="nope.gguf"))
    path = fetch("tiny-org/tiny-gguf", HubOptions(gguf_file="tiny.Q8_0.gguf"))
    assert path.name == "tiny.Q8_0.gguf" and path.read_bytes().startswith(b"GGUF8")
    assert _files(path.parent) == {"tiny.Q8_0.gguf"}
    assert cached("tiny-org/tiny-gguf", HubOptions(gguf_file="tiny.Q8_0.gguf")) == path


def test_free_disk_is_checked_before_the_weights_with_the_layer_cache(online: LocalHub, tiny_llama: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    weights = (tiny_llama / "model.safetensors").stat().st_size
    monkeypatch.setattr(hub_mod, "disk_free", lambda path: hub_mod.DISK_MARGIN + weights + (1 << 20))
    big = lambda snapshot: [(Path("/tmp"), 5 << 30)]             # noqa: E731 -- a 5 GiB layer cache
    with pytest.raises(ConfigError, match=r"not enough disk space .* needs 0\.00046 GB in .* \+ 5\.37 GB in /tmp"):
        fetch(REPO, HubOptions(reserve=big))
    assert not online.gets(online.by_sha("model.safetensors", REPO))        # refused before any weight byte
    assert _files(fetch(REPO, HubOptions())) == LOADED                        # fits without the layer cache


def test_layer_cache_estimate_matches_the_cache_planner(tiny_llama: Path) -> None:
    from offload.cache import store as layer_cache
    from specexec.checkpoints.naming import layer_names

    args = read_args(tiny_llama)
    engine = EngineConfig(dtype="float32")
    assert layer_cache_bytes(args, OffloadConfig(), engine) == 0                  # fits: resident, no cache
    planned = layer_cache.plan(tiny_llama, layer_names(tiny_llama, args), "nf4", torch.float32, False)
    assert [layer_bytes(args, "nf4", torch.float32)] * args.n_layers == [lay.nbytes for lay in planned]
    need = layer_cache_bytes(args, OffloadConfig(offload="ssd", quant="nf4"), engine)
    assert need == sum(lay.nbytes for lay in planned) + layer_cache.SPACE_MARGIN


def test_older_http_get_without_tqdm_class_still_reports_and_resumes(online: LocalHub, tiny_llama: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import file_download

    real = file_download.http_get

    def old_style(url, temp_file, *, resume_size=0, headers=None, expected_size=None, _tqdm_bar=None, **retry):
        """No tqdm_class parameter (retries inside the real one come back through here with theirs)."""
        return real(url, temp_file, resume_size=resume_size, headers=headers, expected_size=expected_size,
                    _tqdm_bar=_tqdm_bar, **retry)

    monkeypatch.setattr(file_download, "http_get", old_style)
    online.drop_after_half.add("model.safetensors")
    seen: list[int] = []
    path = fetch(REPO, HubOptions(progress=lambda d, t, n: seen.append(d)))
    total = sum((tiny_llama / n).stat().st_size for n in LOADED)
    assert seen[-1] == total and _sha(path / "model.safetensors") == online.by_sha("model.safetensors", REPO)
    assert online.gets(online.by_sha("model.safetensors", REPO))[1].range.startswith("bytes=")


def test_convert_downloads_a_hub_id_then_builds_its_cache(online: LocalHub, capsys, tmp_path: Path) -> None:
    assert main(["convert", "--model", REPO, "--quant", "nf4", "--out", str(tmp_path / "c"), "--no-progress"]) == 0
    assert "(built): 2 layers, nf4" in capsys.readouterr().out
    assert len(online.gets(online.by_sha("model.safetensors", REPO))) == 1
