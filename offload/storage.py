"""Packed layers: one decoder layer's tensors (quantized data + quantization state + norms/biases) in ONE
contiguous uint8 buffer with an offset table, so moving a layer between tiers is a single copy and the
tensors are rebuilt on the destination as views without allocation.

Does not know: what the tensors mean (names are opaque), models, tokens.

CONTRACT (shared by quant.py, cache.py, tiers.py, pager.py; implemented by the storage/quant/cache owner):

    ALIGN = 4096                                   # every packed layer's size is a multiple of ALIGN (O_DIRECT)

    @dataclass(frozen=True)
    class Entry:                                   # one tensor inside a packed buffer
        name: str; dtype: str; shape: tuple[int, ...]; offset: int; nbytes: int
                                                   # offsets are 64-byte aligned

    @dataclass(frozen=True)
    class LayerLayout:                             # json-serialisable via to_dict()/from_dict()
        entries: tuple[Entry, ...]
        nbytes: int                                # padded total, multiple of ALIGN
        meta: dict                                 # opaque json-able metadata (e.g. quantization state fields)

    def pack_layer(tensors: dict[str, torch.Tensor], meta: dict | None = None) -> tuple[torch.Tensor, LayerLayout]
        # -> (uint8 [layout.nbytes] CPU buffer, layout)
    def unpack_layer(buffer: torch.Tensor, layout: LayerLayout) -> dict[str, torch.Tensor]
        # views into `buffer` (any device), no allocation
"""
