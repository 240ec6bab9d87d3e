"""Experts computed where they lie: the routed expert FFNs of some streamed sparse layers run on the CPU, in RAM,
while attention, router and shared expert run on the compute device (--experts cpu[:N] / auto; docs/
algorithms.md §25).

For each such layer `CpuExperts` holds the layer's experts as modules bound (quant.bind_module: views, no copy)
to the layer's packed bytes in the pager's RAM tier, so the CPU kernels (the int4/int8 integer kernels of
cpu_kernels/ for int4/int8 layers, F.linear for unquantized ones) compute on the very bytes a
streamed pass would have copied. The pager moves only the layer's dense part into the slot (the layer's head,
as for any streamed sparse layer); `ExpertStream` (expert_stream.py) skips the expert copies for these layers
and hands the combination to `combine`: the T rows' hidden states [T, D] and their routing (index [T, k],
weight [T, k]) cross to the CPU, SparseMLP.routed gathers each expert's rows, computes them, weights them and
scatters them back (the same code, order and bytes as on the device, so a CPU run is bit for bit the streamed
one), the routed sum [T, D] crosses back and the shared expert is added on the device. Bytes crossed per layer
and pass: 2 x T x D x the run dtype's size plus T x k x (8 + that size) of routing; no expert weight moves. On a
CPU the device is the CPU: nothing is copied at all (the saving is the streamed experts' memcpy).

Row exactness: each row's result depends on that row and the bytes only (the CPU integer kernels are
row-exact), so a tree pass gives every node its one-token bits, as the streamed path does.

Counters (stats.moe): cpu_expert_rows (rows whose experts ran on the CPU, summed over layers),
cpu_expert_layers (layer passes), cpu_expert_bytes_crossed (hidden states and routing, both ways).

Does not know: which layers should compute on the CPU (specexec/planning/expert_place.py), trees, the engine.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from offload.quant.linear import swap_linears
from offload.streaming.storage import unpack_layer

from specexec.config import ModelArgs
from specexec.network.model import Block, on_meta
from specexec.network.moe import Routing, SparseMLP
from specexec.options import ConfigError
from specexec.runtime.expert_stream import bind_experts

PORTABLE = ("none", "int8")      # formats whose packed bytes read the same on a CPU and on CUDA


class CpuExperts:
    """The CPU-computed experts of some sparse layers (see the module docstring). experts[i]: layer i's E expert
    modules, bound to host memory."""

    def __init__(self, experts: dict[int, nn.ModuleList]) -> None:
        self.experts = experts
        self.counters = {"cpu_expert_rows": 0.0, "cpu_expert_layers": 0.0, "cpu_expert_bytes_crossed": 0.0}

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.experts))

    def __contains__(self, layer: int) -> bool:
        return layer in self.experts

    def combine(self, layer: int, mlp: SparseMLP, h: Tensor, routing: Routing) -> Tensor:
        """h [B, T, D] on the device and its routing -> the layer's feed-forward output [B, T, D] there: the
        routed experts on the CPU, the shared expert on the device."""
        x = h.reshape(-1, h.shape[-1])
        here = x.device.type == "cpu"
        xe = mlp.expert_input(x)                     # what the experts read (normed first beside a dense MLP)
        xc = xe if here else xe.to("cpu")
        rc = routing if here else Routing(routing.index.to("cpu"), routing.weight.to("cpu"))
        out = mlp.routed(xc, rc, self.experts[layer])
        if not here:
            out = out.to(x.device)
            elt = x.element_size()
            self.counters["cpu_expert_bytes_crossed"] += (2 * x.numel() * elt + routing.index.numel() * 8
                                                          + routing.weight.numel() * routing.weight.element_size())
        self.counters["cpu_expert_rows"] += x.shape[0]
        self.counters["cpu_expert_layers"] += 1
        return mlp.add_shared(x, out).view_as(h)


def check_cpu_format(fmt: str, device: torch.device | str) -> None:
    """ConfigError (one line) unless a layer cache of `fmt` made for `device` can be computed on the CPU: on a
    CPU any format; on CUDA only formats whose packing is the same for both (int4 and nf4 are packed for the GPU)."""
    if torch.device(device).type != "cpu" and fmt not in PORTABLE:
        raise ConfigError(f"--experts cpu on {device} computes experts from the layer cache's bytes with the CPU "
                          f"kernels; {fmt} layers are packed for the GPU: use --quant int8 or none with --experts "
                          "cpu, or --experts stream")


def cpu_experts(args: ModelArgs, layers: Sequence[int], buffers: dict[int, Tensor], layouts: Sequence,
                fmt: str, dtype: torch.dtype) -> CpuExperts:
    """CpuExperts over `layers`, each bound to buffers[i] (layer i's packed bytes in host RAM: the pager's RAM
    tier) through its layout."""
    out: dict[int, nn.ModuleList] = {}
    for i in layers:
        with on_meta():
            block = Block(args, i)
        experts = block.mlp.experts
        swap_linears(experts, fmt, dtype)
        lay = layouts[i]
        bind_experts(block, unpack_layer(buffers[i], lay), lay.meta)
        out[i] = experts.eval().requires_grad_(False)
    return CpuExperts(out)


def crossed_bytes(rows: int, dim: int, top_k: int, dtype: torch.dtype) -> int:
    """What one layer pass of `rows` rows moves across the link (module docstring), for tests and the plan."""
    elt = torch.empty((), dtype=dtype).element_size()
    return 2 * rows * dim * elt + rows * top_k * (8 + elt)

