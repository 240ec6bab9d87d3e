"""The network's maths: the decoder (model.py), attention, norms, RoPE and LongRoPE, the dense FFN and the MoE block.

It does not know where weights live (streamed, resident, quantized): the runtime binds those; nor which family
a checkpoint is (specexec/families/ names the per-family differences this package reads).
"""
