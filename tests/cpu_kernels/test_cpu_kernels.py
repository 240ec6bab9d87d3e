"""The CPU integer kernels (cpu_kernels/): every ISA variant this machine runs (the AVX2 register
tiles with 256-bit VNNI (AVX512-VL or AVX-VNNI) or without, the wide AVX-512 VNNI path, plain C) against the pure-torch reference to fp32 rounding, for every int4 group size, shapes with partial chunks
and blocks, fp32/bf16 activations and bias; rows that do not depend on the batch; the activations' int8 codes
the reference computes are the kernels' own; the result close to the float matmul; and the pure-torch path, with
its one line, when there is no compiler or the kernels are switched off.
"""
from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cpu_kernels import abi, build, ops

X86 = platform.machine().lower() in ("x86_64", "amd64")
# variant -> (extra compiler flags, the ISA it reports, a /proc/cpuinfo flag it needs)
VARIANTS = {"native": ([], None, None), "avx2": (["-mno-avx512f", "-mno-avxvnni"], "avx2", "avx2"),
            "avx2-2x8": (["-mno-avx512f", "-mno-avxvnni", "-DQR=2", "-DQA=8"], "avx2", "avx2"),   # other tiles
            "avx2-vnni": (["-mno-avx512vnni"], "avx2-vnni", "avx_vnni"),     # the tiles with AVX-VNNI's vpdpbusd
            "wide": (["-DSX_WIDE"], "avx512vnni", "avx512_vnni"),             # the AVX-512 path (-DSX_WIDE)
            "scalar": (["-march=x86-64"], "scalar", None)}
Q4_SHAPES = [(64, 256, 64), (48, 96, 32), (40, 384, 128), (16, 160, 32), (24, 448, 64), (16, 32, 32)]


def _cpu_has(flag: str) -> bool:
    try:
        return f" {flag} " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


# native is what the product builds; each other variant compiles the library again (25-40 s on 2 busy cores): slow
@pytest.fixture(scope="module", params=[v if v == "native" else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS])
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The kernels compiled for one ISA (native = what the product builds), or a skip saying why not."""
    extra, isa, needs = VARIANTS[request.param]
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    if request.param != "native" and not X86:
        pytest.skip("ISA variants are x86 flags")
    if needs and not _cpu_has(needs):
        pytest.skip(f"this CPU has no {needs}")
    if request.param == "native":
        lib = build.library()
        assert lib is not None, build.status()
        return lib
    path = tmp_path_factory.mktemp("kernels") / f"{request.param}.so"
    flags = [f for f in build.FLAGS if f != "-march=native"] + (["-march=native"] if isa != "scalar" else []) + extra
    subprocess.run([cc, *flags, *map(str, build.SOURCES), "-o", str(path), "-lm"], check=True, capture_output=True)
    lib = build.load(path)
    assert lib.sx_isa().decode() == isa
    return lib


@pytest.fixture
def use(variant, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ops, "library", lambda: variant)
    return variant


def _q4(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    s = (0.001 + 0.02 * torch.rand(n, k // group, generator=g)).bfloat16()
    z = (0.01 * torch.randn(n, k // group, generator=g)).bfloat16()
    return ops.pack_q4(q, group), torch.stack([s, z], dim=-1).contiguous()


def _q8(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
            (0.001 + 0.01 * torch.rand(n, generator=g)).bfloat16())


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of fp32 sums (a flipped activation code would be ~1e-3 of the scale); a bf16
    result also to its own rounding (the two sums may round to neighbouring bf16 values)."""
    rtol = 2 ** -8 if got.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=2e-6 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", Q4_SHAPES)
def test_q4_equals_the_reference_and_rows_do_not_depend_on_the_batch(use, n, k, group, dtype) -> None:
    codes, sz = _q4(n, k, group)
    bias = torch.randn(n).to(dtype)
    x = torch.randn(9, k).to(dtype)
    full = ops.q4_linear(x, codes, sz, group, bias)
    assert full.dtype == dtype and full.shape == (9, n)
    want = ops.q4_reference(x, codes, sz, group, bias)
    assert_fp32_close(full, want)
    for m in (1, 3, 4, 5):
        assert torch.equal(ops.q4_linear(x[:m], codes, sz, group, bias), full[:m])
        assert torch.equal(ops.q4_linear(x[m:m + 2], codes, sz, group, bias), full[m:m + 2])


@pytest.mark.parametrize("n,k,group", [(34, 256, 64), (17, 160, 32), (33, 384, 128), (16, 96, 32), (9, 1280, 64),
                                       (5, 2304, 128)])
def test_q4_every_row_count_gives_each_row_its_one_row_bits(use, n, k, group) -> None:
    """The kernels' register tiles (AVX2: 2 weight rows x 4 activation rows, then the rows left; N the tile does
    not divide; at G >= 64 the tiles of several rows take s * d from blocks of 8 groups: 20 and 18 groups here, a
    tail in each): any row count gives each row the bits of its own one-row call, and matches the reference."""
    codes, sz = _q4(n, k, group, seed=3)
    bias = torch.randn(n)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(4))
    single = torch.cat([ops.q4_linear(x[i:i + 1], codes, sz, group, bias) for i in range(17)])
    assert_fp32_close(single, ops.q4_reference(x, codes, sz, group, bias))
    for m in (1, 2, 3, 5, 7, 8, 16, 17):
        assert torch.equal(ops.q4_linear(x[:m], codes, sz, group, bias), single[:m])
        assert torch.equal(ops.q4_linear(x[17 - m:], codes, sz, group, bias), single[17 - m:])



@pytest.mark.slow          # compiles the kernels twice more (~35 s on 2 busy cores)
def test_vnni_tiles_give_the_bits_of_the_maddubs_tiles(tmp_path, monkeypatch) -> None:
    """vpdpbusd sums the same four u8 x s8 products per int32 lane that vpmaddubsw + vpmaddwd do (no int16
    saturation at these magnitudes), so the tiles give the same bits with and without VNNI, at every row count;
    q8 too, where VNNI reads the weight as q + 128 and starts each lane at -128 x its activations' sum."""
    native = build.library()
    if native is None or native.sx_isa().decode() != "avx2-vnni":
        pytest.skip("the product's kernels here are not the VNNI tiles")
    path = tmp_path / "maddubs.so"
    flags = list(build.FLAGS) + ["-mno-avx512f", "-mno-avxvnni"]
    subprocess.run([build.compiler(), *flags, *map(str, build.SOURCES), "-o", str(path), "-lm"], check=True,
                   capture_output=True)
    plain = build.load(path)
    assert plain.sx_isa().decode() == "avx2"
    for n, k, group in Q4_SHAPES:
        codes, sz = _q4(n, k, group)
        x = torch.randn(17, k)
        outs = []
        for lib in (native, plain):
            monkeypatch.setattr(ops, "library", lambda lib=lib: lib)
            outs.append([ops.q4_linear(x[:m], codes, sz, group) for m in (1, 4, 9, 17)])
        assert all(torch.equal(a, b) for a, b in zip(*outs))
    for k in (7, 33, 64, 100, 130, 1536):                # partial chunks, a block of one chunk, whole blocks
        codes, scale = _q8(37, k)
        x = torch.randn(17, k)
        outs = []
        for lib in (native, plain):
            monkeypatch.setattr(ops, "library", lambda lib=lib: lib)
            outs.append([ops.q8_linear(x[:m], codes, scale) for m in (1, 5, 9, 17)])
        assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("k", [7, 32, 33, 64, 100, 130])
def test_q8_equals_the_reference_and_rows_do_not_depend_on_the_batch(use, k) -> None:
    codes, scale = _q8(21, k)
    bias = torch.randn(21)
    x = torch.randn(6, k)
    full = ops.q8_linear(x, codes, scale, bias)
    assert_fp32_close(full, ops.q8_reference(x, codes, scale, bias))
    for m in (1, 4, 5):
        assert torch.equal(ops.q8_linear(x[:m], codes, scale, bias), full[:m])


def test_threads_do_not_change_a_bit(use) -> None:
    codes, sz = _q4(96, 512, 64)
    x = torch.randn(5, 512)
    threads = torch.get_num_threads()
    full = ops.q4_linear(x, codes, sz, 64)
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.q4_linear(x, codes, sz, 64), full)
    finally:
        torch.set_num_threads(threads)


def test_out_buffer_is_filled_in_place(use) -> None:
    codes, sz = _q4(32, 128, 64)
    x, out = torch.randn(2, 128), torch.full((2, 32), float("nan"))
    y = ops.q4_linear(x, codes, sz, 64, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.equal(out, ops.q4_linear(x, codes, sz, 64))
    with pytest.raises(ValueError, match="out must be"):
        ops.q4_linear(x, codes, sz, 64, out=torch.empty(3, 32))


def test_a_bound_linear_takes_any_leading_shape_and_refuses_a_wrong_width(use) -> None:
    codes, sz = _q4(32, 128, 64)
    bound = ops.BoundLinear("q4", codes, sz, 64, None)
    x = torch.randn(2, 3, 128)
    y = bound(x)
    assert y.shape == (2, 3, 32) and torch.equal(y.view(6, 32), bound(x.view(6, 128), out=torch.empty(6, 32)))
    assert torch.equal(bound(x.transpose(0, 1)), y.transpose(0, 1))              # not contiguous: copied first
    with pytest.raises(ValueError, match="features"):
        bound(torch.randn(2, 64))


def test_activation_codes_are_round_half_even_of_the_block_scale() -> None:
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, 63.5, -127.0] + [0.0] * 26])
    q, d = ops.quantize_activations(x, 32)
    assert d.tolist() == [[1.0]] and q[0, :6].tolist() == [127, 0, 2, -2, 64, -127]
    assert ops.quantize_activations(torch.zeros(1, 32), 32)[0].abs().sum() == 0      # an all-zero block


def test_the_kernels_round_ties_to_even_as_the_reference_does(use) -> None:
    """Identity weights (q4: codes 9 on the diagonal, 8 elsewhere, s = 1, z = 0; q8: codes 1, scale 1) return
    the activations' codes times d = 1: ties land on the even neighbour, in both kernels."""
    x = torch.zeros(1, 64)
    x[0, :6] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5, -127.0])
    want = ops.quantize_activations(x, 64)[0].float()
    assert want[0, :6].tolist() == [127, 0, 2, -2, 64, -127]
    q4 = ops.pack_q4(8 + torch.eye(64, dtype=torch.int64), 64)
    sz = torch.tensor([1.0, 0.0]).bfloat16().expand(64, 1, 2).contiguous()
    assert torch.equal(ops.q4_linear(x, q4, sz, 64), want)
    q8 = torch.eye(64, dtype=torch.int8)
    assert torch.equal(ops.q8_linear(x, q8, torch.ones(64).bfloat16()), want)


def test_close_to_the_float_matmul_within_the_activations_rounding() -> None:
    """Against x @ dequantize(W).T with x unrounded: int8 blocks of 64 cost ~0.6 % of the result on gaussian x
    (rounding error d/sqrt(12), d = amax/127 ~ 2.4/127), far below int4's own weight error (~9 %)."""
    codes, sz = _q4(256, 1024, 64)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(5))
    y = ops.q4_linear(x, codes, sz, 64)
    exact = F.linear(x, ops.q4_dequantize(codes, sz, 64))
    err = ((y - exact).norm() / exact.norm()).item()
    assert 2e-3 < err < 1e-2


def test_without_a_compiler_the_torch_path_runs_and_says_so_once(monkeypatch, capsys) -> None:
    codes, sz = _q4(64, 256, 64)
    x = torch.randn(3, 256)
    kernel = ops.q4_linear(x, codes, sz, 64)
    monkeypatch.setattr(build, "compiler", lambda: None)
    build._library.cache_clear()
    build._warn_once.cache_clear()
    try:
        assert build.library() is None and build.library() is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no C compiler" in err[0] and "pure-torch" in err[0]
        assert_fp32_close(ops.q4_linear(x, codes, sz, 64), kernel)
    finally:
        build._library.cache_clear()


def test_a_failing_compiler_and_the_switch_fall_back(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    build._library.cache_clear()
    build._warn_once.cache_clear()
    try:
        assert build.library() is None
        assert "CPU kernels unavailable (false failed on csrc/*.c" in capsys.readouterr().err
        monkeypatch.delenv("CC")
        monkeypatch.setenv(build.ENV_SWITCH, "0")
        build._library.cache_clear()
        assert build.library() is None and capsys.readouterr().err == ""          # asked for: no warning
        assert "off" in build.status()
    finally:
        build._library.cache_clear()


def test_a_struct_mirrored_differently_is_refused_when_the_library_loads(monkeypatch) -> None:
    """block.c's structs are mirrored by hand in abi.py: the library reports its layout (sx_layout) and load
    compares, so a field added on one side only fails at load, in one line naming both layouts."""
    lib = build.library()
    if lib is None:
        pytest.skip(build.status())
    assert build.load(Path(lib._name)) is not None                    # the mirrors agree with the real library

    class Shorter(ctypes.Structure):                                   # the C side's Block without its last linear
        _fields_ = [f for f in abi.Block._fields_ if f[0] != "down"] + [("down", ctypes.c_int32)]
    monkeypatch.setattr(abi, "Block", Shorter)
    with pytest.raises(RuntimeError, match=r"struct layout \[56, 488, .*is not cpu_kernels/abi.py's \[56, 4\d\d"):
        build.load(Path(lib._name))
