"""The llama.cpp rows of `specexec bench` (`--configs llama.cpp`): the same prompts (our prompt ids, so the same
tokens), the same --max-new-tokens, sampling and thread count, through the llama-cpp-python package (the
`llamacpp` extra, never required) on a GGUF file: `--gguf PATH`, or `--model` itself when it is one.

Rows: `llama.cpp` (its plain decode) and `llama.cpp prompt-lookup` (its own speculative mode in this package:
drafts from n-grams of the context, LlamaPromptLookupDecoding; the package has no draft-model mode). tok/s is
new tokens / the time after the first token, as for our rows; TTFT the time to the first token; tokens per pass
only for the plain row (one evaluation per token). llama.cpp's weights are the GGUF's own quantization, so its
output is never called identical to ours (its identical column stays empty).

Without the package, or without a GGUF, the rows are skipped with one line saying why and what to do. The rows
run in a child process (spawned): a crash inside llama.cpp's native code ends that process only, and the bench
keeps every other row and the llama.cpp rows finished before it, with one line saying what died.

Does not know: our runtime, how rows are reported (cli/bench/main.py), GGUF internals.
"""
from __future__ import annotations

import importlib.util
import multiprocessing
import queue as queue_mod
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cli.bench.common import Plan, Result
from specexec.profiler import PeakMemory

KINDS = ("llama.cpp", "llama.cpp prompt-lookup")
INSTALL = "pip install -e '.[llamacpp]' (llama-cpp-python; it compiles llama.cpp)"
LOOKUP_TOKENS = 10          # tokens each prompt-lookup draft proposes (the package's default)


def available() -> bool:
    """llama-cpp-python importable."""
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_for(model: str | None, gguf: str | None) -> Path | None:
    """The GGUF the rows run: --gguf, else --model when it names a .gguf file, else None."""
    if gguf:
        return Path(gguf).expanduser()
    if model and model.endswith(".gguf") and Path(model).expanduser().is_file():
        return Path(model).expanduser()
    return None


def skip_reason(model: str | None, gguf: str | None) -> str | None:
    """One line saying why the llama.cpp rows cannot run here (None: they can)."""
    if not available():
        return f"llama.cpp rows skipped: llama-cpp-python is not installed; {INSTALL}"
    path = gguf_for(model, gguf)
    if path is None:
        return "llama.cpp rows skipped: no GGUF file; pass --gguf PATH (the target as llama.cpp's GGUF)"
    if not path.is_file():
        return f"llama.cpp rows skipped: --gguf {path} is not a file"
    return None


def _generate(llm, ids: list[int], max_new: int, eos: set[int], sampling) -> tuple[list[int], float, float]:
    """(new ids, seconds to the first token, seconds after it) of one prompt."""
    llm.reset()
    kw = {"temp": 0.0, "top_k": 1} if sampling.greedy else {"temp": sampling.temperature, "top_p": sampling.top_p,
                                                             "top_k": sampling.top_k or 0, "min_p": sampling.min_p}
    out: list[int] = []
    t0 = time.perf_counter()
    first = t0
    for tok in llm.generate(ids, repeat_penalty=sampling.repetition_penalty, **kw):
        if not out:
            first = time.perf_counter()
        if tok in eos:
            break
        out.append(int(tok))
        if len(out) >= max_new:
            break
    return out, first - t0, time.perf_counter() - first


def _load(path: Path, lookup: bool, context: int, seed: int | None):
    from llama_cpp import Llama

    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    return Llama(model_path=str(path), n_threads=torch.get_num_threads(), n_ctx=context, verbose=False,
                 seed=seed if seed is not None else 0, draft_model=draft)


def run_llamacpp(path: Path, plan: Plan, prompt_ids: list[list[int]], eos: list[int], warmup: int,
                 progress: Callable[[str], None], done: Callable[[Result], None] = lambda r: None,
                 say: Callable[[str], None] = lambda line: None) -> list[Result]:
    """Both llama.cpp rows (plain, prompt-lookup) over every prompt, one model load per row, in a child process:
    llama.cpp is native code built on the user's machine, and a crash there (a build for CPU instructions this
    machine lacks, a library bug) must cost its rows, not the whole bench. The rows finished before a crash are
    kept; say() hears one line saying what died and what to try."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(str(path), plan.config.max_new_tokens, plan.sampling, prompt_ids, eos,
                                              warmup, torch.get_num_threads(), queue), daemon=True)
    child.start()
    results: list[Result] = []
    while True:
        try:
            kind, value = queue.get(timeout=0.5)
        except queue_mod.Empty:
            if child.is_alive():
                continue
            child.join()
            say(_death_line(child.exitcode, len(results)))
            return results
        if kind == "progress":
            progress(value)
        elif kind == "row":
            results.append(value)
            done(value)
        else:                                           # "end", or "error" with the child's one line
            child.join()
            if kind == "error":
                say(f"llama.cpp rows stopped: {value}")
            return results


def _death_line(code: int | None, kept: int) -> str:
    """One line for a llama.cpp child that died without finishing (a signal: negative exit code)."""
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    return (f"llama.cpp rows stopped: llama-cpp-python's process died ({how}); {kept} of {len(KINDS)} rows kept, "
            "the other rows are unaffected. A build for CPU instructions this machine lacks crashes like this: "
            "reinstall with CMAKE_ARGS='-DGGML_NATIVE=OFF' pip install --force-reinstall --no-cache-dir "
            "llama-cpp-python")


def _child(path: str, max_new: int, sampling, prompt_ids: list[list[int]], eos: list[int], warmup: int,
           threads: int, queue) -> None:
    """The child's side of run_llamacpp: each row, then "end" (or "error" with one line)."""
    torch.set_num_threads(threads)
    context = max(len(ids) for ids in prompt_ids) + max_new + 8
    try:
        for kind in KINDS:
            queue.put(("progress", f"loading {Path(path).name} in llama.cpp"))
            llm = _load(Path(path), kind != "llama.cpp", context, sampling.seed)
            if warmup:
                _generate(llm, prompt_ids[0][:8], warmup, set(eos), sampling)
            res = Result(kind, note=f"llama.cpp ({Path(path).name}), {threads} threads")
            with PeakMemory(torch.device("cpu")) as mem:
                for j, ids in enumerate(prompt_ids, 1):
                    queue.put(("progress", f"{kind} · prompt {j}/{len(prompt_ids)}"))
                    new, ttft, decode = _generate(llm, ids, max_new, set(eos), sampling)
                    res.add(new, len(new) if kind == "llama.cpp" else 0, decode, ttft)
            res.peak_ram = mem.ram_bytes
            queue.put(("row", res))
            del llm
    except Exception as e:                               # noqa: BLE001 - reported as one line by the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))
        return
    queue.put(("end", None))
