"""Steps about the draft side: host syncs per draft pass and per step (`syncs`), CUDA graphs staying on while
the pager reads the SSD tier (`graphs-ssd`), and an NF4 draft pass's time by rows, graphs on and off
(`nf4-draft`).

Does not know: the target's streaming rates (steps_stream.py), exactness in bf16 (steps_exact.py).
"""
from __future__ import annotations

import statistics
import time

from tools.gpu_check.registry import Context, Skip, step

STEP_FIXED = 6                   # host syncs a step may make besides its draft passes (verify, commit, account)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
TREE_K = 257                     # tree-mask width of a 256-node tree (capacity + the trash slot)


@step("syncs", budget_s=15)
def syncs(ctx: Context) -> None:
    """Host syncs: at most one per draft pass, at most a fixed few more per step (CUDA's sync debug mode on a
    GPU, with draft graphs on; the dispatch counter on a CPU: what a GPU would pay)."""
    import torch

    from tools.gpu_check import project as P

    target_path, draft_path = P.tiny_pair(ctx.tmp)
    target, draft = P.load_model(target_path, ctx.device), P.load_model(draft_path, ctx.device)
    builder = P.make_builder("specexec")
    engine = P.Engine(target, draft, P.EngineConfig(budget=64, device=ctx.device), builder)
    builds: list[tuple[int, int]] = []
    inner = builder.build
    watch = P.SyncWatch(ctx.cuda)

    def build(state, *args, **kwargs):
        passes, before = state.passes, watch.count
        tree = inner(state, *args, **kwargs)
        builds.append((state.passes - passes, watch.count - before))
        return tree
    builder.build = build
    runs, n_new = ((P.prompt(3), P.prompt(4)), 48) if ctx.cuda else ((P.prompt(3),), 16)   # the CPU counter is slow
    decode, kinds = [], {}
    with torch.inference_mode():
        for ids in runs:                                               # the second call replays captured graphs
            gen, steps = engine.generate(ids, n_new), []
            with watch:
                while True:
                    n, before = len(builds), watch.count
                    if next(gen, None) is None:
                        break
                    steps.append((watch.count - before, builds[n:]))
                kinds = watch.kinds()
            decode += [(total, b) for total, b in steps[1:] if b]      # each run's first step holds its prefill
    per_pass = max(s / max(p, 1) for total, b in decode for p, s in b)
    extra = max(total - sum(s for _, s in b) for total, b in decode)
    ctx.figure("steps", len(decode))
    ctx.figure("draft_passes", sum(p for _, b in decode for p, _ in b))
    ctx.figure("max_syncs_per_draft_pass", round(per_pass, 3))
    ctx.figure("max_syncs_per_step_besides_drafting", extra)
    ctx.figure("sync_kinds", kinds)
    ctx.check("at most one host sync per draft pass", per_pass <= 1, per_pass, 1)
    ctx.check("a fixed few syncs per step besides the draft", extra <= STEP_FIXED, extra, STEP_FIXED)


NEW_SSD = 24                     # graphs-ssd's tokens per generation


@step("graphs-ssd", budget_s=45, cuda=True, why_cuda="CUDA graphs and the staged SSD reader are CUDA-only")
def graphs_ssd(ctx: Context) -> None:
    """CUDA graphs stay on through an SSD-tier run with a slowed reader (its thread waits on events while the
    draft captures), and the output equals the target alone's."""
    from tools.gpu_check import project as P

    target, draft = P.tiny_pair(ctx.tmp, n_layers=8)
    config = P.EngineConfig(device="cuda", dtype="float32", budget=32, max_new_tokens=NEW_SSD)
    rt = P.Runtime.load(str(target), str(draft), config, offload=P.OffloadConfig(
        offload="ssd", quant="none", cache_dir=str(ctx.tmp / "cache"), ram_budget=P.RAM_BUDGET))
    pager = rt.engine.target.pager
    read = pager.ssd.read_layer
    pager.ssd.read_layer = lambda i, out: (time.sleep(0.02), read(i, out))[1]     # a slow disk
    alone = rt.variant(config, use_draft=False)
    outs = []
    with P.ReaderDuringCapture(pager.copy_stream) as watch:
        ids = P.prompt(3)                    # one prompt: the reader's 20 ms a layer makes each pass slow
        got = [t for s in rt.generate_ids(ids, NEW_SSD) for t in s]
        again = [t for s in rt.generate_ids(ids, NEW_SSD) for t in s]
        want = [t for s in alone.generate_ids(ids, NEW_SSD) for t in s]
        outs.append(got == want == again)
    runner = P.draft_graphs.runner(rt.engine.draft, rt.engine._caches[1], None)
    stats = pager.collect(wait=True)
    ctx.figure("captures", watch.captures)
    ctx.figure("replays", watch.replays)
    ctx.figure("reader_errors", watch.errors)
    ctx.figure("ssd_bytes", stats.bytes["ssd"])
    ctx.figure("passes", stats.passes)
    ctx.check("greedy equals the target alone (fp32), twice", all(outs), outs, "all equal")
    ctx.check("graphs still on after the run", runner is not None and not runner.failed,
              "off" if runner is None or runner.failed else "on", "on")
    ctx.check("captured and replayed", watch.captures > 0 and watch.replays > 0,
              (watch.captures, watch.replays), "> 0 each")
    ctx.check("a reader thread's event wait during a capture is legal", not watch.errors, watch.errors, [])
    ctx.check("the SSD tier streamed", stats.bytes["ssd"] > 0, stats.bytes["ssd"], "> 0")
    rt.engine.close()


def _pass_ms(state, b: int, reps: int = 15) -> float:
    """GPU milliseconds of one draft pass over b rows of a 256-node tree (median of reps, after 3 warm-ups:
    eager, capture, replay)."""
    import torch

    dev = state.cache.k.device
    g = torch.Generator().manual_seed(b)
    L0 = state.cache.length
    tree = torch.rand(b, TREE_K, generator=g) < 0.3
    tree[:, b:] = False
    tree[torch.arange(b), torch.arange(b)] = True
    args = (torch.randint(7, 1000, (b,), generator=g).to(dev), (L0 + tree.sum(1)).to(dev), tree.to(dev),
            (L0 + torch.arange(b)).to(dev))
    times = []
    with torch.inference_mode():
        for k in range(3 + reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            state.forward(*args)
            end.record()
            end.synchronize()
            if k >= 3:
                times.append(start.elapsed_time(end))
    return statistics.median(times)


@step("nf4-draft", budget_s=25, cuda=True, why_cuda="NF4 is bitsandbytes' CUDA kernels; graphs are CUDA-only")
def nf4_draft(ctx: Context) -> None:
    """An NF4 draft of Llama-3.2-1B shapes (16 layers, 128k vocab): pass time at 1..128 rows with CUDA graphs
    on and off, 512 tokens of context."""
    import torch

    from tools.gpu_check import project as P

    try:
        model = P.random_draft("1b", 16, 128256, "nf4", torch.bfloat16)
    except ImportError as e:
        raise Skip(f"bitsandbytes is missing ({e}): carry its wheel (tools/gpu-wheels)") from None
    cache = P.prefilled(model, 512, 4096)
    rows = {}
    for graphs in (False, True):
        state = P.DraftState(model, cache, cuda_graphs=graphs)
        rows["on" if graphs else "off"] = {b: round(_pass_ms(state, b), 3) for b in ROWS}
    runner = P.draft_graphs.runner(model, cache, True)
    ctx.figure("ms_per_pass", rows)
    speedup = {b: round(rows["off"][b] / rows["on"][b], 2) for b in ROWS}
    ctx.figure("graph_speedup", speedup)
    ctx.check("graphs captured every row count", runner is not None and not runner.failed and len(runner.graphs)
              >= len(ROWS), len(runner.graphs) if runner else 0, len(ROWS))
    ctx.check("graphs never slower (5 % noise)", min(speedup.values()) >= 0.95, min(speedup.values()), 0.95)
