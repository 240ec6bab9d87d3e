"""The transformers baselines of `specexec bench`: `hf-offload` (generate() with a device_map under the same
memory limits as ours) and `hf-assisted` (assisted generation with the same draft). Both models load once,
after ours are released, and serve both rows; passes are counted with forward hooks, the first token with a
streamer.

Does not know: our runtime, how rows are reported (cli/bench/main.py).
"""
from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable

import torch

from cli.bench.common import Plan, Result
from cli.bench.progress import tell
from specexec.config import OffloadConfig, SamplingParams
from specexec.profiler import PeakMemory, Profiler


def _hf_dtype_kw(dtype: torch.dtype) -> dict:
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def hf_placement(offload: OffloadConfig, n_layers: int, device: str, folder: str) -> dict:
    """from_pretrained kwargs that put the target where our --offload/--*-budget flags put ours: every layer on
    `disk` for ssd, in CPU RAM for ram (on CUDA), accelerate's device_map='auto' under max_memory for the
    budgets, else everything on the device."""
    dev = "cpu" if device == "cpu" else (0 if device == "cuda" else int(device.split(":")[1]))
    tier = {"ssd": "disk", "ram": "cpu"}.get(offload.offload)
    if tier is not None and not (tier == "cpu" and dev == "cpu"):
        dmap = {"model.embed_tokens": dev, "model.norm": dev, "model.rotary_emb": dev, "lm_head": dev}
        dmap.update({f"model.layers.{i}": tier for i in range(n_layers)})
        return {"device_map": dmap, "offload_folder": folder}
    budgets = {k: v for k, v in ((dev, offload.gpu_budget if dev != "cpu" else offload.ram_budget),
                                 ("cpu", offload.ram_budget)) if v is not None}
    if budgets:
        return {"device_map": "auto", "max_memory": budgets, "offload_folder": folder}
    return {"device_map": {"": dev}}


class _FirstToken:
    """A transformers streamer that marks the first new token (the first put() is the prompt) on a Profiler."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler, self.calls = profiler, 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls > 1:
            self.profiler.first_token()

    def end(self) -> None:
        pass


def _count_passes(model: torch.nn.Module, profiler_ref: list[Profiler]) -> Callable[[], None]:
    """Time every forward of `model` on the current profiler: the first is 'prefill', the rest 'target'."""
    state: dict = {}

    def pre(_m, _a):
        prof = profiler_ref[0]
        state["span"] = prof.start("prefill" if "prefill" not in prof.totals() else "target")

    def post(_m, _a, _o):
        state.pop("span").stop()

    h1, h2 = model.register_forward_pre_hook(pre), model.register_forward_hook(post)
    return lambda: (h1.remove(), h2.remove())


def _generation_config(sampling: SamplingParams, max_new: int, eos: list[int], pad: int | None):
    from transformers import GenerationConfig
    kw = dict(max_new_tokens=max_new, min_new_tokens=0, eos_token_id=eos,
              pad_token_id=pad if pad is not None else eos[0], do_sample=not sampling.greedy,
              repetition_penalty=sampling.repetition_penalty)
    if not sampling.greedy:
        kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None,
                  min_p=sampling.min_p or None)
    return GenerationConfig(**kw)


def _hf_model(path, dtype: torch.dtype, placement: dict):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **_hf_dtype_kw(dtype), **placement)
    return model.eval()


def run_hf(target_path, draft_path, plan: Plan, prompt_ids: list[list[int]], eos: list[int], pad: int | None,
           warmup: int, progress: Callable[[str], None], done: Callable[[Result], None] = lambda r: None
           ) -> list[Result]:
    """hf-offload and hf-assisted on one transformers copy of the target (and of the draft)."""
    from specexec.checkpoints.loading import read_args, resolve_dtype

    kinds = [k for k in ("hf-offload", "hf-assisted") if k in plan.kinds]
    if not kinds:
        return []
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()          # our status line reports progress; transformers' bars would
    hf_logging.set_verbosity_error()           # interleave with it, and its deprecation notes are not ours
    device = plan.config.device
    dtype = resolve_dtype(plan.config.dtype, torch.device(device))
    with tempfile.TemporaryDirectory(prefix="specexec-hf-offload-") as folder:
        progress("loading the transformers target")
        placement = hf_placement(plan.offload, read_args(target_path).n_layers, device, folder)
        target = _hf_model(target_path, dtype, placement)
        draft = None
        if "hf-assisted" in kinds:
            progress("loading the transformers draft")
            draft = _hf_model(draft_path, dtype, {"device_map": {"": device if device != "cuda" else 0}})
        results = []
        for k in kinds:
            results.append(_run_hf_kind(k, target, draft if k == "hf-assisted" else None, plan, prompt_ids, eos,
                                        pad, warmup, progress))
            done(results[-1])
        del target, draft
        gc.collect()
    return results


def _hf_generate(target, draft, ids: list[int], gen_cfg, profiler: Profiler, seed: int | None,
                 device: torch.device) -> list[int]:
    if seed is not None:
        torch.manual_seed(seed)
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        out = target.generate(x, attention_mask=torch.ones_like(x), generation_config=gen_cfg,
                              assistant_model=draft, streamer=_FirstToken(profiler))
    return out[0, len(ids):].tolist()


def _run_hf_kind(kind: str, target, draft, plan: Plan, prompt_ids: list[list[int]], eos: list[int],
                 pad: int | None, warmup: int, progress: Callable[[str], None]) -> Result:
    device = torch.device(plan.config.device)
    gen_cfg = _generation_config(plan.sampling, plan.config.max_new_tokens, eos, pad)
    prof_ref = [Profiler(device)]
    remove = _count_passes(target, prof_ref)
    try:
        if warmup:
            _hf_generate(target, draft, prompt_ids[0][:8], _generation_config(plan.sampling, warmup, eos, pad),
                         prof_ref[0], plan.sampling.seed, device)
        res = Result(kind, note="transformers generate(), unquantized")
        with PeakMemory(device) as mem:
            for j, ids in enumerate(prompt_ids):
                tell(progress, kind, j, len(prompt_ids))
                prof = prof_ref[0] = Profiler(device)
                new = _hf_generate(target, draft, ids, gen_cfg, prof, plan.sampling.seed, device)
                spans = prof.totals()
                prefill_s = spans.get("prefill", {}).get("ms", 0.0) / 1000
                passes = int(sum(t["calls"] for t in spans.values()))
                res.add(new, passes, max(prof.wall_s - prefill_s, 0.0), prof.ttft_s)
            tell(progress, kind, len(prompt_ids), len(prompt_ids))
        res.peak_ram, res.peak_vram = mem.ram_bytes, mem.vram_bytes
        return res
    finally:
        remove()


