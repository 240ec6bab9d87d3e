"""Shared fixtures: tiny random Llama-family checkpoints written once per test session, and the `gpu` marker.

Every model fixture returns the Path of a real Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja) in a session-scoped temporary directory; see
tests/tiny_models.py for the shapes, the tokenizer and the weight init. Nothing is downloaded: the Hub is
switched offline before transformers is imported.
"""
from __future__ import annotations

import os
import signal

# A suite started as a background job (`pytest &` in a non-interactive shell) inherits SIGINT ignored, and an
# ignored signal stays ignored across exec: every child that must stop on Ctrl-C (chat, convert, serve) would
# then run on. Catching SIGINT here (Python's own handler) makes every child start with the default disposition,
# so Python installs its KeyboardInterrupt handler in each of them again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The commands the tests run (in-process through cli.main.main, and as child processes) take one thread, as the
# suite does below: $OMP_NUM_THREADS counts as --threads (cli/threads.py), so no run's threads follow the load.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.tiny_models import (DRAFT_PERTURB, FAMILY_MODELS, HYBRID_MODELS, LLAMA3_ROPE, family_model, hybrid_model,
                               write_tiny_model)

# Tiny models: one thread is fastest, and on a shared 2-core machine two threads oversubscribe badly.
torch.set_num_threads(1)

# name -> (family, seed, config overrides); seeds differ so no two fixtures share weights.
SINGLE_MODELS: dict[str, tuple[str, int, dict]] = {
    "llama": ("llama", 0, {}),
    "llama3": ("llama", 1, {"rope_scaling": LLAMA3_ROPE}),
    "qwen2": ("qwen2", 2, {}),
    "qwen2_tied": ("qwen2", 3, {"tie_word_embeddings": True}),
    "mistral": ("mistral", 4, {}),
    "qwen3": ("qwen3", 5, {}),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding a `slow` test run first (in their own order), so pytest-xdist, which hands out whole files
    in collection order, starts the long ones early and ends on short ones instead of one worker finishing a
    minute-long file alone. Tests marked `gpu` are skipped when there is no CUDA device."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)            # stable: each file keeps its order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# What a machine without the POSIX-only facilities lacks (Windows; offload/platform/facilities.py has the stand-ins).
POSIX_ONLY = ("O_DIRECT", "O_DIRECTORY", "preadv", "pread", "pwrite", "posix_fadvise")


@pytest.fixture(params=["native", "fallback"])
def posix_facilities(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: on this machine as it is, then with every POSIX-only facility taken away, as on
    Windows: no O_DIRECT, O_DIRECTORY, os.preadv/pread/pwrite, os.posix_fadvise (reads go through lseek +
    readinto, no page-cache hints); fcntl and msvcrt unimportable (locks are lock directories); no
    cudaHostRegister (pinning goes through torch's allocator); no signal.SIGTERM. Returns the mode."""
    if request.param == "fallback":
        import signal
        import sys
        from types import SimpleNamespace

        for name in POSIX_ONLY:
            monkeypatch.delattr(os, name, raising=False)
        monkeypatch.setitem(sys.modules, "fcntl", None)           # `import fcntl` raises ImportError
        monkeypatch.setitem(sys.modules, "msvcrt", None)
        monkeypatch.delattr(signal, "SIGTERM", raising=False)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace())
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _quiet_transformers() -> None:
    """No progress bars from save_pretrained/from_pretrained in test output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _run_kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled CPU kernels' directory that this run's xdist workers share (each worker's basetemp is a
    folder of the run's): the library is built once per run, not once per worker (cpu_kernels/build.py names
    it by a hash of its sources, compiler and CPU and renames a finished build into place)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "cpu-kernels"
    shared.mkdir(mode=0o700, exist_ok=True)
    return shared


@pytest.fixture(scope="session", autouse=True)
def _private_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Whatever cache a test does not name itself lands in this session's temporary directory (one per xdist
    worker), never in ~/.cache or a developer's $SPECEXEC_CACHE: $SPECEXEC_CACHE and $XDG_CACHE_HOME point there
    (subprocesses inherit them), except the compiled CPU kernels, which the run's workers share (_run_kernels). A
    test's own monkeypatch.setenv still wins."""
    root = tmp_path_factory.mktemp("caches")
    (root / "specexec").mkdir()
    (root / "specexec" / "kernels").symlink_to(_run_kernels(tmp_path_factory), target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECEXEC_CACHE", str(root / "specexec"))
        mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))
        yield


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's directory that holds every tiny checkpoint."""
    return tmp_path_factory.mktemp("tiny_models")


def _single(root: Path, name: str) -> Path:
    family, seed, overrides = SINGLE_MODELS[name]
    return write_tiny_model(root / name, family, seed=seed, n_layers=2, **overrides)


@pytest.fixture(scope="session")
def tiny_llama(tiny_root: Path) -> Path:
    """Llama, 2 layers, plain RoPE."""
    return _single(tiny_root, "llama")


@pytest.fixture(scope="session")
def tiny_llama3(tiny_root: Path) -> Path:
    """Llama, 2 layers, Llama-3.1-style rope_scaling (rope_type llama3, factor 8, original max 64)."""
    return _single(tiny_root, "llama3")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_root: Path) -> Path:
    """Qwen2, 2 layers: q/k/v biases, untied head."""
    return _single(tiny_root, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen2_tied(tiny_root: Path) -> Path:
    """Qwen2, 2 layers, tie_word_embeddings=True (no lm_head.weight in the safetensors file)."""
    return _single(tiny_root, "qwen2_tied")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_root: Path) -> Path:
    """Mistral, 2 layers, sliding_window null (as in Mistral v0.2+)."""
    return _single(tiny_root, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_root: Path) -> Path:
    """Qwen3, 2 layers: per-head q_norm/k_norm, explicit head_dim 16."""
    return _single(tiny_root, "qwen3")


@pytest.fixture(scope="session", params=list(SINGLE_MODELS))
def tiny_model(request: pytest.FixtureRequest) -> Path:
    """Each single-model fixture in turn (test ids: llama, llama3, qwen2, qwen2_tied, mistral, qwen3)."""
    return request.getfixturevalue(f"tiny_{request.param}")


# MoE targets: name -> (family, seed, layers, config overrides); shapes in tests/tiny_models.MOE_SHAPES.
MOE_MODELS: dict[str, tuple[str, int, int, dict]] = {
    "qwen3_moe": ("qwen3_moe", 20, 3, {"mlp_only_layers": [1]}),     # 16 experts top-4; layer 1 dense
    "qwen2_moe": ("qwen2_moe", 24, 3, {}),                            # shared expert + gate; layers 0, 2 dense
    "mixtral": ("mixtral", 21, 2, {}),                                # 4 experts top-2
    "olmoe": ("olmoe", 22, 2, {}),                                    # q/k norms over the projections, clip_qkv
    "gpt_oss": ("gpt_oss", 23, 2, {}),                                # sinks, sliding/full layers, YaRN, biases
    "glm4_moe": ("glm4_moe", 25, 3, {}),        # layer 0 dense; sigmoid + bias, 4 groups top-2, shared, x2.5
    "minimax_m2": ("minimax_m2", 26, 2, {}),    # q/k norms over the projections, rotary 12 of 16, sigmoid + bias
    "deepseek_v3": ("deepseek_v3", 27, 3, {}),  # latent attention (ranks 48/32, YaRN + mscale), GLM's routing
    "gemma4_moe": ("gemma4_moe", 28, 3, {}),    # Gemma 4's routed block beside the dense MLP, its full layers
}


def _moe(root: Path, name: str) -> Path:
    family, seed, layers, overrides = MOE_MODELS[name]
    return write_tiny_model(root / f"moe-{name}", family, seed=seed, n_layers=layers, **overrides)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_root: Path) -> Path:
    """Qwen3-MoE, 3 layers (layer 1 a dense MLP via mlp_only_layers), 16 experts of 32, top-4, renormalised."""
    return _moe(tiny_root, "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tiny_root: Path) -> Path:
    """Qwen2-MoE, 3 layers (decoder_sparse_step 2: layer 1 routed, 0 and 2 dense), 8 experts of 32 top-2 without
    renormalising, a shared expert of 48 behind its sigmoid gate, q/k/v biases."""
    return _moe(tiny_root, "qwen2_moe")


@pytest.fixture(scope="session")
def tiny_mixtral(tiny_root: Path) -> Path:
    """Mixtral, 2 layers, 4 experts of 64, top-2 (block_sparse_moe.experts.N.w1/w2/w3 in the checkpoint)."""
    return _moe(tiny_root, "mixtral")


@pytest.fixture(scope="session")
def tiny_olmoe(tiny_root: Path) -> Path:
    """OLMoE, 2 layers, 8 experts of 32, top-2 without renormalising; q/k norms over the projections, clip_qkv 1."""
    return _moe(tiny_root, "olmoe")


@pytest.fixture(scope="session")
def tiny_gpt_oss(tiny_root: Path) -> Path:
    """gpt-oss, 2 layers (sliding window 8, then full attention), attention sinks, YaRN RoPE, q/k/v/o and
    router and expert biases, 8 experts of 32 top-2 with the clamped gated activation; experts stored fused."""
    return _moe(tiny_root, "gpt_oss")


@pytest.fixture(scope="session")
def tiny_glm4_moe(tiny_root: Path) -> Path:
    """GLM-4.5 MoE, 3 layers (layer 0 dense), 16 experts of 32 in 4 groups, top-4 from the best 2 groups by
    sigmoid + score bias, x2.5, one shared expert; per-head q/k norms, q/k/v biases, rotary 8 of 16."""
    return _moe(tiny_root, "glm4_moe")


@pytest.fixture(scope="session")
def tiny_minimax_m2(tiny_root: Path) -> Path:
    """MiniMax-M2, 2 layers, 8 experts of 32, top-2 by sigmoid + score bias; q/k norms over the whole
    projections, rotary 12 of 16."""
    return _moe(tiny_root, "minimax_m2")


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tiny_root: Path) -> Path:
    """DeepSeek-V3, 3 layers (layer 0 dense): latent attention (q rank 48, kv rank 32, 16 + 8 rotary key dims,
    values of 12, interleaved RoPE, YaRN x4 with mscale 0.7 / 1.0), GLM's routing (16 experts in 4 groups)."""
    return _moe(tiny_root, "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_gemma4_moe(tiny_root: Path) -> Path:
    """Gemma 4 with its routed block (26B-A4B's): 3 layers (sliding, sliding, full with heads of 32 and keys as
    values), 8 experts of 32 top-2 beside each dense MLP, routed on the normed residual, experts stored fused."""
    return _moe(tiny_root, "gemma4_moe")


@pytest.fixture(scope="session")
def tiny_gpt_oss_mxfp4(tiny_root: Path, tiny_gpt_oss: Path) -> Path:
    """tiny_gpt_oss with its fused expert weights in MXFP4 (X_blocks/X_scales, quant_method mxfp4), as the
    Hub's gpt-oss checkpoints store them."""
    from tests.offload.formats.mxfp4_writer import write_mxfp4
    return write_mxfp4(tiny_root / "moe-gpt_oss-mxfp4", tiny_gpt_oss)


@pytest.fixture(scope="session", params=list(MOE_MODELS))
def tiny_moe(request: pytest.FixtureRequest) -> Path:
    """Each MoE family's tiny checkpoint in turn (test ids: the MOE_MODELS names), written by transformers."""
    return request.getfixturevalue(f"tiny_{request.param}")


# The Qwen hybrids (tests/tiny_models.HYBRID_MODELS): three Gated DeltaNet layers to one gated full-attention layer.
@pytest.fixture(scope="session", params=list(HYBRID_MODELS))
def tiny_hybrid(request: pytest.FixtureRequest, tiny_root: Path) -> Path:
    """Each hybrid family's tiny checkpoint in turn (qwen3_5, qwen3_next, qwen3_5_moe, qwen3_5_mm)."""
    return hybrid_model(tiny_root, request.param)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tiny_root: Path) -> Path:
    """Dense Qwen3.5 (Qwen3_5ForCausalLM), 4 layers: linear, linear, linear, full attention."""
    return hybrid_model(tiny_root, "qwen3_5")


@pytest.fixture(scope="session", params=list(FAMILY_MODELS))
def tiny_family(request: pytest.FixtureRequest, tiny_root: Path) -> Path:
    """Each family of FAMILY_MODELS in turn (tests/tiny_models.family_kwargs: the options that matter)."""
    return family_model(tiny_root, request.param)


@pytest.fixture(scope="session")
def tiny_pair(tiny_root: Path) -> tuple[Path, Path]:
    """(target, draft): Llama 4 layers and Llama 2 layers, same tokenizer, unrelated random weights."""
    target = write_tiny_model(tiny_root / "pair-target", "llama", seed=10, n_layers=4)
    draft = write_tiny_model(tiny_root / "pair-draft", "llama", seed=11, n_layers=2)
    return target, draft


@pytest.fixture(scope="session")
def tiny_perturbed_draft(tiny_root: Path, tiny_pair: tuple[Path, Path]) -> Path:
    """A copy of tiny_pair's target with relative noise DRAFT_PERTURB on every weight (~78% top-1 agreement)."""
    return write_tiny_model(tiny_root / "pair-target-perturbed", perturb=DRAFT_PERTURB, base=tiny_pair[0], seed=12)


@pytest.fixture(scope="session")
def tiny_small_pair(tiny_pair: tuple[Path, Path], tiny_root: Path) -> tuple[Path, Path]:
    """(target, draft) at half the depth, for the tests that run the engine thousands of times: tiny_pair's
    2-layer draft as the target, and a copy of it with relative noise DRAFT_PERTURB as its draft."""
    target = tiny_pair[1]
    return target, write_tiny_model(tiny_root / "pair-draft-perturbed", perturb=DRAFT_PERTURB, base=target, seed=14)


@pytest.fixture(scope="session")
def tiny_mismatched_draft(tiny_root: Path) -> Path:
    """A Llama 2-layer draft whose tokenizer disagrees with every other fixture's (vocab 288, other ids)."""
    return write_tiny_model(tiny_root / "mismatched-draft", "llama", seed=13, n_layers=2, tokenizer="other")
