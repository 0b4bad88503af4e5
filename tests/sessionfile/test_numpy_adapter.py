"""A NumPy adapter in the shape the reference engine uses (per-layer K/V arrays [capacity, kv_heads, head_dim],
f16 or int8 with per-token-per-head f32 scales, sliding-window layers as a ring of the last W tokens kept in
logical order on disk), copying straight between its arrays and the library's memoryviews. It passes the
conformance kit; it is also a worked example for engine authors. Skipped where numpy is not installed."""

from __future__ import annotations

import pytest
from strata_sessionfile import (
    BlockBuffers,
    DType,
    EngineLimits,
    LayerGeometry,
    LayerRole,
    LayerSpec,
    Part,
    RunningState,
    SessionAdapter,
    Snapshot,
    restore,
    save,
)
from strata_sessionfile.testing import fake_identity, run_conformance

np = pytest.importorskip("numpy")  # the package does not need numpy: where it stands alone, this skips

NP_DTYPES = {DType.F16: np.float16, DType.F32: np.float32, DType.I8: np.int8}


class NumpyKV:
    """One layer's pool: K, V (and scales for int8); a window layer is a ring of W slots."""

    def __init__(self, spec: LayerSpec, n_ctx: int) -> None:
        self.spec = spec
        cap = spec.window or n_ctx
        self.parts = {
            Part.K: np.zeros((cap, spec.n_kv_heads, spec.head_dim_k), NP_DTYPES[spec.k_dtype]),
            Part.V: np.zeros((cap, spec.n_kv_heads, spec.head_dim_v), NP_DTYPES[spec.v_dtype]),
        }
        if spec.k_dtype == DType.I8:
            self.parts[Part.K_SCALES] = np.zeros((cap, spec.n_kv_heads), np.float32)
        if spec.v_dtype == DType.I8:
            self.parts[Part.V_SCALES] = np.zeros((cap, spec.n_kv_heads), np.float32)
        self.n_seen = 0  # tokens appended since the start of the session

    def held(self) -> int:
        return min(self.n_seen, self.spec.window) if self.spec.window else self.n_seen

    def logical_runs(self, part: Part, held: int) -> list[np.ndarray]:
        """The part's bytes in logical (oldest-first) order, as 1 or 2 contiguous uint8 views."""
        arr = self.parts[part]
        if not self.spec.window or self.n_seen <= self.spec.window:
            runs = [arr[:held]]
        else:
            start = self.n_seen % self.spec.window  # the oldest token's slot
            runs = [arr[start:], arr[:start]]
        return [r.reshape(-1).view(np.uint8) for r in runs]


def copy_bytes(runs: list[np.ndarray], offset: int, out: np.ndarray | None, src: np.ndarray | None) -> None:
    """Copy bytes [offset, offset + n) of the concatenated runs to `out`, or from `src` into them."""
    n = len(out if out is not None else src)
    pos = 0
    for run in runs:
        if offset >= len(run):
            offset -= len(run)
            continue
        take = min(n - pos, len(run) - offset)
        if out is not None:
            out[pos : pos + take] = run[offset : offset + take]
        else:
            run[offset : offset + take] = src[pos : pos + take]
        pos += take
        offset = 0
        if pos == n:
            return


class NumpyAdapter:
    def __init__(self, specs, n_ctx: int = 256) -> None:
        self.specs = tuple(specs)
        self.n_ctx = n_ctx
        self.layers = [NumpyKV(s, n_ctx) for s in specs]
        self.state = RunningState([])
        self._identity = fake_identity("numpy-model", {"engine": "numpy-test", "kv": "mixed", "n_ctx": n_ctx})
        self.fail_stopped = None

    def decode(self, tokens, seed: int) -> None:
        """Fake decoding: append tokens, writing K/V rows (ring slots for window layers)."""
        rng = np.random.default_rng(seed)
        for _token in tokens:
            for kv in self.layers:
                slot = kv.n_seen % kv.spec.window if kv.spec.window else kv.n_seen
                for arr in kv.parts.values():
                    arr[slot] = (
                        rng.standard_normal(arr.shape[1:]).astype(arr.dtype)
                        if arr.dtype != np.int8
                        else rng.integers(-127, 128, arr.shape[1:], dtype=np.int8)
                    )
                kv.n_seen += 1
        toks = list(self.state.tokens) + list(tokens)
        self.state = RunningState(toks, len(toks), b"rng", self.state.checkpoint, b"")

    # SessionSource
    def identity(self):
        return self._identity

    def snapshot(self):
        return Snapshot(self.state, tuple(LayerGeometry(kv.spec, kv.held()) for kv in self.layers))

    def copy_out(self, layer, part, offset, dest):
        kv = self.layers[layer]
        copy_bytes(kv.logical_runs(part, kv.held()), offset, np.frombuffer(dest, np.uint8), None)

    # SessionTarget
    def limits(self):
        return EngineLimits(max_tokens=self.n_ctx, layers=self.specs)

    def check_plan(self, plan):
        pass

    def begin_apply(self, plan):
        # Restored rows land in logical order from slot 0; with n_seen = held, a full ring (held == W) has
        # its oldest token at slot n_seen % W == 0, so decoding continues the ring correctly.
        for kv, g in zip(self.layers, plan.layers, strict=True):
            kv.n_seen = g.tokens_held

    def copy_in(self, layer, part, offset, src):
        kv = self.layers[layer]
        copy_bytes(kv.logical_runs(part, kv.held()), offset, None, np.frombuffer(src, np.uint8))

    def commit(self, state):
        self.state = state

    def fail_stop(self, error):
        self.fail_stopped = error  # a real engine stops decoding (and exits with its fail-stop status)

    def logical(self, layer: int, part: Part) -> bytes:
        kv = self.layers[layer]
        return b"".join(r.tobytes() for r in kv.logical_runs(part, kv.held()))


SPECS = [
    LayerSpec(0, LayerRole.MAIN, 2, 16, 16, DType.F16, DType.F16, 0),
    LayerSpec(1, LayerRole.MAIN, 2, 16, 16, DType.F16, DType.F16, 32),  # sliding window of 32
    LayerSpec(2, LayerRole.MAIN, 2, 16, 16, DType.I8, DType.I8, 0),
]


def make(seed: int, n: int = 90) -> NumpyAdapter:
    a = NumpyAdapter(SPECS)
    a.decode(list(range(seed, seed + n)), seed)
    return a


def test_numpy_adapter_satisfies_the_protocol():
    assert isinstance(make(1), SessionAdapter)


@pytest.mark.parametrize("mode", ["streaming"])
def test_ring_layers_round_trip_in_logical_order(tmp_path, mode):
    src = make(1)
    assert src.layers[1].n_seen > 32  # the ring has wrapped
    path = tmp_path / "np.ssf"
    buffers = BlockBuffers(4096)
    save(path, src, block_size=4096, buffers=buffers)
    dst = make(7, n=10)
    restore(path, dst, block_size=4096, mode=mode, buffers=buffers)
    for li in range(len(SPECS)):
        for part in src.layers[li].parts:
            assert dst.logical(li, part) == src.logical(li, part), (li, part)
    assert list(dst.state.tokens) == list(src.state.tokens)
    # decoding continues identically on both after the restore
    src.decode([5, 6, 7], 99)
    dst.decode([5, 6, 7], 99)
    for li in range(len(SPECS)):
        assert dst.logical(li, Part.K) == src.logical(li, Part.K)


def test_numpy_adapter_passes_conformance(tmp_path):
    run_conformance(lambda seed: make(seed, n=80 + seed), tmp_path, random_flips=24, random_truncations=6)
