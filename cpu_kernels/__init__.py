"""The bottom layer: specexec's compiled CPU kernels and their pure-torch twins. The integer linears (ops.py: 4-bit
and 8-bit weights x int8 activations), row-by-row attention (attend.py), one dense decoder layer in one call
(block.py), the bandwidth probe; the C sources in csrc/, compiled on first use (build.py), their ctypes interface
(abi.py); and the one directory where specexec keeps what it builds on a machine (cache_root.py).

Imports nothing of specexec's other packages (tests/test_layering.py): offload's quantized linears and the
network's attention call down into it. docs/layout.md maps the files.
"""
