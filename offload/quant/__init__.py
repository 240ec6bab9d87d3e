"""Quantized weights (weights.py, linear.py, int4.py, int8.py). Here only the format names, torch-free, so the
command line lists and checks them (--quant, --draft-quant) without importing torch."""

FORMATS = ("none", "nf4", "fp4", "int8", "int4")
