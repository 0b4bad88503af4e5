"""The q8 products (`--cpu-kernels numba-q8`: activations quantized to int8 per 32-value block, integer dot
products with AVX512-VNNI) against the numpy oracle of the same quantized math (`ops/q8.py`), and against
the float32 product within the quantization's bound; the machine check's fallback to the float32 kernels."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from strata_engine.ops import get_ops

from .weights import EXTRA_LAYOUTS, made_packed, random_packed, real_weights

# |y - oracle| <= Q8_ORACLE_RTOL * (|x| @ |W|^T): the same integer dots, float32 scaling and sums in another
# order (measured: ~2e-8).
Q8_ORACLE_RTOL = 1e-6
# Against the float32 product: each x is off by at most half its block's step (dx / 2), so |y - x W^T| <=
# (dx / 2 per value) @ |W|^T, plus round-off; relative to |x| @ |W|^T measured 1.2e-3 .. 1.6e-3 on random x.
Q8_RTOL = 5e-3
ROUND_OFF = 1e-5

numba_q8 = pytest.importorskip("strata_engine.ops.numba_q8")
needs_vnni = pytest.mark.skipif(not numba_q8.HAS_VNNI, reason="the CPU has no AVX512-VNNI")


@pytest.fixture(scope="module", params=["serial", "parallel"])
def q8_ops(request):
    """The numba ops with q8 products, on the calling thread or over all threads (thresholds at zero)."""
    from strata_engine.ops import numba_ops as module

    ops = get_ops("numpy", "f32", "numba-q8", threads=2)
    if request.param == "serial":
        yield ops
        return
    saved = module.PARALLEL_MIN_BYTES
    module.PARALLEL_MIN_BYTES = 0
    yield ops
    module.PARALLEL_MIN_BYTES = saved


def _check(got, x, w, name):
    """got against the quantized oracle (round-off) and the float32 product (the quantization's bound)."""
    from strata_engine.ops import q8

    dense = w.dequantize().astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(dense).T
    assert got.dtype == np.float32 and got.shape == (x.shape[0], w.shape[0]), name
    oracle = q8.matmul_q8(x, w)
    assert np.all(np.abs(got - oracle) <= Q8_ORACLE_RTOL * scale), (
        f"{name}: {np.max(np.abs(got - oracle) / scale):.1e}"
    )
    _, dx = q8.quantize_rows(x)
    half_step = np.repeat(dx.astype(np.float64) / 2, q8.QX, axis=1) @ np.abs(dense).T
    err = np.abs(got - x.astype(np.float64) @ dense.T)
    assert np.all(err <= half_step + ROUND_OFF * scale), name
    assert np.max(err / scale) <= Q8_RTOL, f"{name}: {np.max(err / scale):.1e}"


def test_quantization_matches_the_oracle_per_weight_block():
    """`quantize_q8` (and its parallel form, from Q8_PARALLEL_ROWS rows) gives `q8.quantize_rows`' values in
    order (4 a dword) and, per weight block of 16 or 32 values, its activation block's dx, -128 * the sum of its
    qx and dx * that sum; halves round away from zero; a row view that is not contiguous reads the same."""
    from strata_engine.ops import q8

    rng = np.random.default_rng(20)
    m = numba_q8.Q8_PARALLEL_ROWS + 1
    for k in (512, 576, 640):
        x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 100, (m, 1))).astype(np.float32)
        x[1, :32] = 0  # a block of zeros: dx 0, qx 0
        x[2, :32] = np.resize(
            np.float32([127, 2.5, -2.5, 0.5, -0.5, 126.5, -126.5, 1.5]), 32
        )  # dx 1: exact halves
        qx, dx = q8.quantize_rows(x)
        assert np.abs(qx).max() <= 127 and np.all(qx[1, :32] == 0)
        assert list(qx[2, :8]) == [127, 3, -3, 1, -1, 127, -127, 2]
        for block in (16, 32):
            sums = qx.astype(np.int64).reshape(m, k // block, block).sum(-1)
            block_dx = np.repeat(dx, 32 // block, axis=1)
            wide = np.zeros((m, 2 * k), dtype=np.float32)
            wide[:, ::2] = x
            for quantize, rows in ((numba_q8.quantize_q8, x), (numba_q8.quantize_q8_parallel, x),
                                   (numba_q8.quantize_q8, wide[:, ::2])):  # fmt: skip
                xq, dxw, xneg, xsum = quantize(rows, block)
                np.testing.assert_array_equal(xq.view(np.int8), qx)
                np.testing.assert_array_equal(dxw, block_dx)
                np.testing.assert_array_equal(xneg, -128 * sums)
                np.testing.assert_array_equal(xsum, (block_dx * sums.astype(np.float32)).astype(np.float32))


def test_a_tiled_weight_keeps_its_bytes_and_reads_its_rows_in_order():
    """`tile` interleaves 16 rows a dword (values) and a block (scales, mins) at a time, the shape and bytes
    unchanged; `natural`, `take`, `dequantize` and tile-aligned `rows` give the untiled weight's rows; rows off the
    tiles and weights of part tiles are refused."""
    from strata_engine.ops.packed import PACKERS, TILE_ROWS

    rng = np.random.default_rng(25)
    weights = [random_packed(t, 48, 512, rng)[0] for t in PACKERS]
    weights += [made_packed(layout, 48, 512, rng) for layout in EXTRA_LAYOUTS]
    for w in weights:
        tiled = w.tile()
        assert tiled.tiled and not w.tiled and tiled.tile() is tiled and w.natural() is w
        assert tiled.shape == w.shape and tiled.nbytes == w.nbytes and tiled.values.dtype == w.values.dtype
        dwords = w.values.view(np.int32)
        np.testing.assert_array_equal(
            tiled.values.view(np.int32)[0, :TILE_ROWS], dwords[:TILE_ROWS, 0]
        )  # row l's dword 0
        flat = tiled.scale.reshape(-1)  # tile 0: block 1 of its 16 rows after their block 0
        np.testing.assert_array_equal(flat[TILE_ROWS : 2 * TILE_ROWS], w.scale[:TILE_ROWS, 1])
        back = tiled.natural()
        for name in ("values", "scale", "min"):
            np.testing.assert_array_equal(getattr(back, name), getattr(w, name))
        rows = np.array([47, 0, 17, 17, 31])
        np.testing.assert_array_equal(tiled.take(rows).dequantize(), w.take(rows).dequantize())
        np.testing.assert_array_equal(tiled.dequantize(), w.dequantize())
        part = tiled.rows(16, 48)
        assert part.tiled and np.shares_memory(part.values, tiled.values)
        np.testing.assert_array_equal(part.dequantize(), w.rows(16, 48).dequantize())
        with pytest.raises(ValueError, match="tiles"):
            tiled.rows(8, 24)
    with pytest.raises(ValueError, match="cannot be tiled"):
        made_packed(EXTRA_LAYOUTS[0], 9, 512, rng).tile()


def test_a_five_bit_weight_keeps_every_value_in_fewer_bytes():
    """A tiled int8 weight of 32-value blocks with every value in -16..15 (Q5_0's) kept in 5 bits: 4-bit pairs and a
    word of high bits a block and row (5/8 of the int8 bytes, the scales as they were); `natural` gives the int8
    weight back, as do `rows`, `take` and `dequantize`; any other weight is refused."""
    from strata_engine.ops.packed import PACKERS, TILE_ROWS, PackedWeight

    rng = np.random.default_rng(26)
    q5 = next(t for t in PACKERS if t.name == "Q5_0")
    w = random_packed(q5, 48, 640, rng)[0]
    assert w.values.min() == -16 and w.values.max() == 15  # the whole range
    five = w.tile().as_five_bit()
    assert five.five_bit and five.tiled and not five.four_bit and five.shape == w.shape
    assert five.values.nbytes + five.high.nbytes == w.values.nbytes * 5 // 8
    back = five.natural()
    assert not back.tiled and not back.five_bit and back.min is None
    np.testing.assert_array_equal(back.values, w.values)
    np.testing.assert_array_equal(back.scale, w.scale)
    np.testing.assert_array_equal(five.dequantize(), w.dequantize())
    rows = np.array([47, 0, 17, 17, 31])
    np.testing.assert_array_equal(five.take(rows).dequantize(), w.take(rows).dequantize())
    part = five.rows(TILE_ROWS, 48)
    assert part.five_bit and np.shares_memory(part.high, five.high)
    np.testing.assert_array_equal(part.natural().values, w.values[TILE_ROWS:48])
    wide = PackedWeight(np.where(w.values == 15, np.int8(16), w.values), w.scale, None, w.block).tile()
    untiled_or_other = [
        w,
        wide,
        *(random_packed(t, 48, 512, rng)[0].tile() for t in PACKERS if t.name != "Q5_0"),
    ]
    for other in untiled_or_other:
        if other.fits_five_bits():  # another type's values may fall in range (Q8_0 of small weights)
            continue
        with pytest.raises(ValueError, match="5 bits"):
            other.as_five_bit()
    assert not w.fits_five_bits() and not wide.fits_five_bits()


@needs_vnni
@pytest.mark.parametrize("parallel", [False, True])
def test_five_bit_products_equal_the_int8_ones_bit_for_bit(parallel):
    """The q8 kernel on a weight in 5 bits sums the same integers as on its int8 form (u = q + 16, the sum started at
    -16 sum(qx) instead of -128 sum(qx)): the products are equal bit for bit, 1-17 token rows."""
    from strata_engine.ops.packed import PackedWeight

    rng = np.random.default_rng(27)
    for n, k in ((48, 640), (1536, 576)):
        scale = (rng.random((n, k // 32)) / 64).astype(np.float16).view(np.uint16)
        tiled = PackedWeight(rng.integers(-16, 16, (n, k), dtype=np.int8), scale, None, 32).tile()
        five = tiled.as_five_bit()
        for n_tok in (1, 2, 7, 8, 9, 17):
            x = rng.standard_normal((n_tok, k)).astype(np.float32)
            np.testing.assert_array_equal(
                numba_q8.product(x, five, parallel), numba_q8.product(x, tiled, parallel)
            )


@needs_vnni
def test_the_loader_tiles_what_the_q8_kernels_take(gemma3_path):
    """A numba-q8 runner's packed weights are tiled (its products never meet an untiled one), its Q5_0 ones in 5
    bits, a numba one's neither; gemma3's tied embeddings, tiled, give the untiled table's rows."""
    import attrs
    from strata_engine.ops.packed import PackedWeight
    from strata_engine.settings import EngineSettings

    from .runners import load_runner

    def packed(model):
        layers = [[getattr(layer, f.name) for f in attrs.fields(type(layer))] for layer in model.layers]
        return [w for w in [*vars(model).values(), *sum(layers, [])] if isinstance(w, PackedWeight)]

    runners = {k: load_runner(EngineSettings(model_path=str(gemma3_path), n_ctx=64, cpu_kernels=k))
               for k in ("numba-q8", "numba")}  # fmt: skip
    q8_weights, f32_weights = packed(runners["numba-q8"].model), packed(runners["numba"].model)
    assert q8_weights and all(w.tiled for w in q8_weights)
    assert f32_weights and not any(w.tiled or w.five_bit for w in f32_weights)
    # Q5_0 in 5 bits: every layer's gate/up, the fused Q/K/V where V is Q5_0 too (9 of 18: Q8_0 in the others)
    q8_layers = runners["numba-q8"].model.layers
    assert all(layer.w_gate_up.five_bit for layer in q8_layers)
    assert sum(layer.wqkv.five_bit for layer in q8_layers) == 9
    assert not runners["numba-q8"].model.output.five_bit
    ids = np.array([2, 106, 262143, 5])
    np.testing.assert_array_equal(
        runners["numba-q8"].model.ops.embed(runners["numba-q8"].model.tok_embd, ids),
        runners["numba"].model.ops.embed(runners["numba"].model.tok_embd, ids),
    )


@needs_vnni
@pytest.mark.parametrize("n_tok", [*range(1, 17), 64, 65])
def test_q8_products_match_the_oracle_for_every_packing(q8_ops, n_tok):
    """Every GGUF type's packing and the made layouts, tiled (48 weight rows: three tiles), K of 16, 18 and 20
    blocks of 32, through `NumbaOps.packed_matmul`; a row's result does not depend on the rows beside it nor on
    its place among them."""
    from strata_engine.ops.packed import PACKERS

    rng = np.random.default_rng(21)
    for k in (512, 576, 640):
        weights = [
            (t.name, random_packed(t, 48, k if t.name[-1] != "K" else 256 * (k // 256), rng)[0])
            for t in PACKERS
        ]
        weights += [(str(layout), made_packed(layout, 48, k, rng)) for layout in EXTRA_LAYOUTS]
        for name, w in weights:
            tiled = q8_ops.packed_layout(w)
            assert tiled.tiled, name
            x = rng.standard_normal((n_tok, w.shape[1])).astype(np.float32)
            got = q8_ops.packed_matmul(x, tiled)
            _check(got, x, w, f"{name} K={w.shape[1]}")
            flipped = q8_ops.packed_matmul(np.ascontiguousarray(x[::-1]), tiled)
            np.testing.assert_array_equal(flipped[::-1], got, err_msg=name)


@needs_vnni
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("n_tok", [1, 8, 64, 65, 600])
def test_q8_products_on_real_weights(q8_ops, model_files, name, n_tok):
    """Both models' weight shapes (layer 0's fused products, the head's first 4,096 rows) through `matmul`:
    the q8 kernel at every row count (batch-invariant, the default), and with invariance off up to Q8_MAX_ROWS
    rows (a prefill chunk), the float32 BLAS path above."""
    from strata_engine.ops.numba_ops import Q8_MAX_ROWS

    rng = np.random.default_rng(22)
    for w, dense in real_weights(model_files[name], 4096):
        x = rng.standard_normal((n_tok, dense.shape[1])).astype(np.float32)
        got = q8_ops.matmul(x, q8_ops.packed_layout(w))
        if n_tok <= Q8_MAX_ROWS or q8_ops.batch_invariant:
            _check(got, x, w, f"{name} {dense.shape}")
        else:
            want = x.astype(np.float64) @ dense.T.astype(np.float64)
            assert np.all(np.abs(got - want) <= ROUND_OFF * (np.abs(x) @ np.abs(dense).T))


@needs_vnni
def test_q8_kernels_compile_once_per_layout(q8_ops):
    """A layout's q8 kernel compiles once: 1, 8 or 20 token rows, K of 16 or 18 blocks, one or two tiles, pass
    the same types (another signature would compile in a request)."""
    rng = np.random.default_rng(24)
    w = q8_ops.packed_layout(
        made_packed(EXTRA_LAYOUTS[2], 16, 512, rng)
    )  # int8 16-value blocks, float32 scales, a min
    for n_tok in (1, 64):  # the serial kernel, and the parallel one from PARALLEL_MIN_BYTES
        q8_ops.matmul(rng.standard_normal((n_tok, 512)).astype(np.float32), w)
    before = len(numba_q8.matmul_q8.signatures), len(numba_q8.matmul_q8_serial.signatures)
    for k in (512, 576):
        w = q8_ops.packed_layout(made_packed(EXTRA_LAYOUTS[2], 32, k, rng))
        for n_tok in (1, 8, 20):
            q8_ops.matmul(rng.standard_normal((n_tok, k)).astype(np.float32), w)
    assert (len(numba_q8.matmul_q8.signatures), len(numba_q8.matmul_q8_serial.signatures)) == before


def test_without_vnni_the_float32_kernels_run(monkeypatch):
    """A CPU (or NUMBA_CPU_FEATURES) without avx512vnni: `numba-q8` ops multiply with the float32 kernels,
    giving their results bit for bit; a packing the q8 kernels do not take (rows of part blocks, part tiles)
    stays untiled and does the same."""
    from strata_engine.ops import numba_ops as module
    from strata_engine.ops.packed import PackedWeight

    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx512f,+avx512bw,-avx512vnni")
    assert not numba_q8.target_has_vnni()
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx512f,+avx512bw,+avx512vnni")
    assert numba_q8.target_has_vnni()
    monkeypatch.setattr(module.numba_q8, "HAS_VNNI", False)
    ops = get_ops("numpy", "f32", "numba-q8", threads=1)
    assert not ops.q8
    rng = np.random.default_rng(23)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    w = made_packed(EXTRA_LAYOUTS[0], 9, 512, rng)
    np.testing.assert_array_equal(ops.matmul(x, w), ops.packed_matmul(x, w, q8=False))
    odd = PackedWeight(rng.integers(-9, 9, (5, 48), dtype=np.int8), np.ones((5, 3), np.float32), None, 16)
    assert not numba_q8.takes(odd)  # 48 values: not whole 32-value activation blocks
    monkeypatch.setattr(module.numba_q8, "HAS_VNNI", True)
    q8_ops = get_ops("numpy", "f32", "numba-q8", threads=1)
    assert q8_ops.q8
    x48 = rng.standard_normal((2, 48)).astype(np.float32)
    assert not q8_ops.packed_layout(odd).tiled
    np.testing.assert_array_equal(q8_ops.matmul(x48, odd), q8_ops.packed_matmul(x48, odd, q8=False))
    part_tile = made_packed(EXTRA_LAYOUTS[0], 9, 512, rng)  # 9 rows: not whole 16-row tiles
    assert not numba_q8.takes(part_tile) and not q8_ops.packed_layout(part_tile).tiled
    np.testing.assert_array_equal(q8_ops.matmul(x, part_tile), q8_ops.packed_matmul(x, part_tile, q8=False))


def test_numba_q8_is_a_cpu_kernels_choice_computing_in_f32():
    from strata_engine.errors import SettingsError
    from strata_engine.settings import EngineSettings

    assert EngineSettings(model_path="x", cpu_kernels="numba-q8").cpu_kernels == "numba-q8"
    with pytest.raises(SettingsError, match="cpu_kernels 'numba-q8' computes in f32"):
        EngineSettings(model_path="x", cpu_kernels="numba-q8", compute_dtype="f64")
    assert get_ops("numpy", "f32", "numba-q8", threads=1).q8 == numba_q8.HAS_VNNI


# The engine with q8 products against itself with float32 ones, teacher-forced on llama.cpp's tokens for
# every reference prompt (f16 K/V, 32 steps): max |logit difference| over the whole vocabulary (measured
# 0.7 .. 2.5 on logits of magnitude 26 .. 44; llama.cpp's own top-5 log-probabilities are 0.3 .. 1.0 from
# the float32 path's).
Q8_LOGIT_BOUND = 4.0
LLAMA_CPP_MARGIN = 0.5


@needs_vnni
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_q8_engine_matches_llama_cpp_while_its_margin_is_clear(name):
    """Greedy decoding with q8 products gives llama.cpp's tokens up to its first step whose top-1 margin is
    <= 0.5 (as the default path must), and its logits stay within Q8_LOGIT_BOUND of the float32 products'."""
    from strata_engine.settings import EngineSettings
    from support.data import gemma3_model_path, smollm2_model_path

    from .runners import greedy, load_runner, reference, top2_margin

    path = smollm2_model_path() if name == "smollm2" else gemma3_model_path()
    runners = {
        kernels: load_runner(EngineSettings(model_path=path, kv_type="f16", n_ctx=256, cpu_kernels=kernels))
        for kernels in ("numba-q8", "numba")
    }
    runner = runners["numba-q8"]
    assert runner.model.ops.q8
    worst = 0.0
    for case in reference("llamacpp", name)["complete"]:
        tokens, _ = greedy(runner, case["prompt_tokens"])
        upto = next(
            (i for i, top5 in enumerate(case["top5"]) if top2_margin(top5) <= LLAMA_CPP_MARGIN), len(tokens)
        )
        assert tokens[:upto] == case["tokens"][:upto], f"prompt {case['prompt']!r} (compared {upto} steps)"
        forced = {}
        for kernels, each in runners.items():
            each.erase()
            steps = [each.prefill(case["prompt_tokens"]).logits]
            steps += [each.decode(t) for t in case["tokens"][:-1]]
            forced[kernels] = np.stack(steps)
        worst = max(worst, float(np.abs(forced["numba-q8"] - forced["numba"]).max()))
    assert worst <= Q8_LOGIT_BOUND, f"{name}: max |logit difference| {worst:.2f}"
