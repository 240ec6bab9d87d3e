"""The GPU check: everything a lent GPU must show, in one run of at most eight minutes (of a 600-s command),
the gpu tests at least four of them.

`tools/gpu-check` (the entry point) installs the wheels carried in .whl/ (tools/gpu-wheels downloads them
here: what the project requires and the lent image lacks, image.py), then runs every registered step
(registry.py) in its own process under one deadline (driver.py), each bounded by its budget, and writes
OUT/summary.json with every figure and verdict, OUT/console.log and OUT/steps.log.

The steps, in order (`tools/gpu-check --list` prints them with their budgets):
  env         versions, the GPU, the project imports, bitsandbytes present       (steps_basic.py)
  syncs       host syncs per draft pass (<= 1) and per step                      (steps_draft.py)
  graphs-ssd  CUDA graphs stay on through an SSD-tier run with a slowed reader   (steps_draft.py)
  nf4-draft   NF4 draft pass time at 1..128 rows, graphs on and off              (steps_draft.py)
  greedy      greedy with a draft vs --no-draft: fp32 equal, bf16 near-ties only (steps_exact.py)
  ram-stream  the RAM tier's pass GB/s vs the pinned peak; resident layer order  (steps_stream.py)
  memory      peak GPU memory vs the ledger                                      (steps_stream.py)
  moe-stream  a small MoE streamed from RAM (bf16, NF4): exact, expert bytes     (steps_moe.py)
  doctor      specexec doctor --json                                             (steps_basic.py)
  gpu-tests   pytest -m gpu, with the rest of the deadline                       (steps_tests.py)
In CPU mode (no CUDA, --cpu, --dry-run) every step that can run on a CPU runs and the others report skipped
with their reason; --dry-run also hides the packages the lent image lacks, as that machine would.

Does not know: specexec's internals beyond the names project.py imports.
"""
