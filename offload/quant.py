"""Quantization of decoder-layer weights with bitsandbytes (NF4, FP4, 8-bit blockwise) or none, and a drop-in
replacement for nn.Linear that runs on CPU and CUDA.

Does not know: model architectures beyond "2-D weights of nn.Linear", tokens, offloading.

CONTRACT (implemented by the quant owner; used by storage/cache and by specexec/offloaded.py):

    FORMATS = ("none", "nf4", "fp4", "int8")

    def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype,
                         linear_names: set[str], double_quant: bool = False
                         ) -> tuple[dict[str, torch.Tensor], dict]
        # Quantize the weights named in linear_names (2-D), cast every other tensor to dtype.
        # Returns flat tensors (e.g. "<name>.qdata", "<name>.absmax", ...) + json-able meta per weight,
        # ready for storage.pack_layer(tensors, meta).

    class QuantLinear(nn.Module):
        # forward(x [..., in]) -> [..., out]; multi-token inputs dequantize ONCE per call and run one GEMM.
        # bind(views: dict[str, torch.Tensor], meta: dict, prefix: str) points it at (new) storage views
        #   without allocating (used by the pager to re-target a slot module at another layer).

    def swap_linears(module: nn.Module, fmt: str, dtype: torch.dtype) -> None
        # replace every nn.Linear inside `module` by a QuantLinear of format fmt (meta-device friendly).
    def bind_module(module: nn.Module, views: dict[str, torch.Tensor], meta: dict) -> None
        # point every parameter/QuantLinear of `module` at the views of one unpacked layer (names as in
        # module.named_parameters(), quantized weights under their "<name>.*" keys).
"""
