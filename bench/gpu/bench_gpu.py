"""Prefill and decode tokens/s of the CuPy backend against Hugging Face transformers on the same GPU,
with the same (dequantized GGUF) weights in the same dtype, measured in one run.

    python3 bench/gpu/bench_gpu.py --model smollm2=PATH --model gemma3=PATH [--lengths 512,4096] \
        [--long 32768] [--dtype f16] [--decode 64] [--peer smollm2=llama-bench.json ...]

Per model and prompt length L: the engine's prefill of L deterministic token ids (chunks of
--chunk tokens, by default the engine's) and 64 greedy decode steps after it (replayed CUDA graphs
unless the engine falls back to op by op; the line says which); transformers (LlamaForCausalLM /
Gemma3ForCausalLM built from the GGUF metadata, sdpa attention, logits of the last token only) the same.
Both synchronise the device before reading the clock; a 256-token run of each is a warm-up (kernel
compilation, cuBLAS handles), and each length is run --repeat times (best reported). Prefill steps
of models without sliding-window rings replay the engine's prefill graphs (captured when the runner is
loaded, as a server's start-up; the capture time is printed): the line then says how many replays and
gives the first run's rate too. Decode is timed three ways: greedy with the logits downloaded and argmaxed
on the host each step (what a host sampler pays); the logits downloaded and nothing sampled, the same token
fed back (what llama-bench's tg runs time); greedy on the device (`decode_row(argmax_only=True)`: the
server's path for a greedy request, only the argmax downloaded). `--peer NAME=FILE` prints llama-bench's
decode at the same tokens held beside the last two (its `-o json` output of `-n 128 -d L,...`; `gpu_run.sh peer-bench`
makes it). The first greedy token of both is printed as a sanity check (the same
weights should give the same token unless the top two are within rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def engine_runner(path: Path, n_ctx: int, dtype: str, chunk: int):
    from strata_engine.settings import EngineSettings
    from strata_engine.slots import SlotSet

    return SlotSet.load(
        EngineSettings(model_path=path, n_ctx=n_ctx, backend="cupy", compute_dtype=dtype, prefill_chunk=chunk)
    ).runners[0]


def time_engine(runner, tokens: list[int], n_decode: int) -> dict:
    ops = runner.model.ops
    runner.erase()
    ops.synchronize()
    replays = sum(g.launches for g in runner.graphs.prefill)
    t0 = time.perf_counter()
    logits = runner.prefill(tokens).logits  # logits on the host: the device work is done
    t_prefill = time.perf_counter() - t0
    replays = sum(g.launches for g in runner.graphs.prefill) - replays
    first = int(np.argmax(logits))
    tok = first
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(runner.decode(tok)))
    t_decode = time.perf_counter() - t0
    # llama-bench's tg: steps whose logits reach the host, nothing sampled (the same token fed back).
    t0 = time.perf_counter()
    for _ in range(n_decode):
        runner.decode(first)
    t_tg = time.perf_counter() - t0
    # The server's greedy rows: the argmax is computed in the step and only it is downloaded.
    tok = first
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = runner.decode_row(tok, argmax_only=True).token
    t_greedy = time.perf_counter() - t0
    graph = runner.graphs.decode
    return {
        "prefill_s": t_prefill, "decode_s": t_decode, "tg_s": t_tg, "greedy_s": t_greedy, "first_token": first,
        "decode_graph": graph is not None and graph.launches > 0, "prefill_graph_replays": replays,
    }  # fmt: skip


# ---- transformers with the GGUF's weights ------------------------------------------------------------
def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) for transformers' rotate-half."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_model(path: Path, dtype: str):
    import torch
    import transformers
    from strata_engine.config import ModelConfig
    from strata_engine.gguf import dequantize_tensor, read_gguf

    g = read_gguf(path)
    c = ModelConfig.from_gguf(g)
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    common = dict(
        vocab_size=c.n_vocab,
        hidden_size=c.n_embd,
        intermediate_size=c.n_ff,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_head_kv,
        head_dim=c.head_dim,
        max_position_embeddings=max(c.n_ctx_train, 40000),
        rms_norm_eps=c.rms_eps,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    sd: dict[str, np.ndarray] = {}

    def t(name: str) -> np.ndarray:
        return dequantize_tensor(g, name)

    if c.architecture == "llama":
        cfg = transformers.LlamaConfig(
            rope_parameters={"rope_type": "default", "rope_theta": c.layers[0].rope_base}, **common
        )
        cls = transformers.LlamaForCausalLM
        for i in range(c.n_layer):
            p = f"model.layers.{i}."
            sd[p + "self_attn.q_proj.weight"] = _unpermute(t(f"blk.{i}.attn_q.weight"), c.n_head)
            sd[p + "self_attn.k_proj.weight"] = _unpermute(t(f"blk.{i}.attn_k.weight"), c.n_head_kv)
            sd[p + "self_attn.v_proj.weight"] = t(f"blk.{i}.attn_v.weight")
            sd[p + "self_attn.o_proj.weight"] = t(f"blk.{i}.attn_output.weight")
            sd[p + "input_layernorm.weight"] = t(f"blk.{i}.attn_norm.weight")
            sd[p + "post_attention_layernorm.weight"] = t(f"blk.{i}.ffn_norm.weight")
            sd[p + "mlp.gate_proj.weight"] = t(f"blk.{i}.ffn_gate.weight")
            sd[p + "mlp.up_proj.weight"] = t(f"blk.{i}.ffn_up.weight")
            sd[p + "mlp.down_proj.weight"] = t(f"blk.{i}.ffn_down.weight")
        sd["model.norm.weight"] = t("output_norm.weight")
    elif c.architecture == "gemma3":
        window = next(lc.window for lc in c.layers if lc.window is not None)
        cfg = transformers.Gemma3TextConfig(
            sliding_window=window,
            query_pre_attn_scalar=round(c.attn_scale**-2),
            layer_types=["sliding_attention" if lc.window else "full_attention" for lc in c.layers],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": c.layers[5].rope_base},
                "sliding_attention": {"rope_type": "default", "rope_theta": c.layers[0].rope_base},
            },
            hidden_activation="gelu_pytorch_tanh",
            **common,
        )
        cls = transformers.Gemma3ForCausalLM
        for i in range(c.n_layer):
            p = f"model.layers.{i}."
            for hf, gg in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                           ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                           ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                           ("mlp.down_proj", "ffn_down")):  # fmt: skip
                sd[p + hf + ".weight"] = t(f"blk.{i}.{gg}.weight")
            # GGUF norm weights hold gemma's +1; transformers adds it itself.
            for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm"),
                           ("pre_feedforward_layernorm", "ffn_norm"), ("post_feedforward_layernorm", "post_ffw_norm"),
                           ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")):  # fmt: skip
                sd[p + hf + ".weight"] = t(f"blk.{i}.{gg}.weight") - 1.0
        sd["model.norm.weight"] = t("output_norm.weight") - 1.0
    else:
        raise SystemExit(f"no transformers mapping for {c.architecture}")
    sd["model.embed_tokens.weight"] = t("token_embd.weight")
    model = cls(cfg).to(tdt)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(tdt) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise SystemExit(f"transformers state dict: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to("cuda").eval()


def time_hf(model, tokens: list[int], n_decode: int) -> dict:
    import torch

    ids = torch.tensor([tokens], device="cuda")
    with torch.inference_mode():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        first = int(out.logits[0, -1].argmax())
        torch.cuda.synchronize()
        t_prefill = time.perf_counter() - t0
        past = out.past_key_values
        nxt = torch.tensor([[first]], device="cuda")
        t0 = time.perf_counter()
        for _ in range(n_decode):
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            int(nxt)  # the engine also reads every token on the host
        torch.cuda.synchronize()
        t_decode = time.perf_counter() - t0
    return {"prefill_s": t_prefill, "decode_s": t_decode, "first_token": first}


def peer_decode(path: Path) -> dict[int, float]:
    """llama-bench's JSON records: decode tok/s (its tg runs) by the tokens held before them (n_depth)."""
    return {
        r["n_depth"]: r["avg_ts"]
        for r in json.loads(path.read_text())
        if r["n_prompt"] == 0 and r["n_gen"] > 0
    }


def _total(r: dict) -> float:
    return r["prefill_s"] + r["decode_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="NAME=PATH (repeatable)")
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--long", default="", help="extra lengths for gemma3 only, e.g. 32768")
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument(
        "--chunk", type=int, default=None, help="prefill chunk (default: the engine's, 4096 on cupy)"
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--repeat", type=int, default=2, help="runs per length; the best is reported")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--peer",
        action="append",
        default=[],
        help="NAME=FILE: llama-bench's -o json output for that model (tg runs at -d depths), printed beside",
    )
    args = ap.parse_args()
    peers = {name: peer_decode(Path(f)) for name, f in (spec.split("=", 1) for spec in args.peer)}
    rows = []
    for spec in args.model:
        name, path = spec.split("=", 1)
        lengths = [int(x) for x in args.lengths.split(",")]
        if name == "gemma3" and args.long:
            lengths += [int(x) for x in args.long.split(",")]
        n_ctx = max(lengths) + 3 * args.decode + 8  # three decode loops a run
        toks = np.random.default_rng(7).integers(100, 5000, max(lengths)).tolist()
        runner = engine_runner(Path(path), n_ctx, args.dtype, args.chunk)
        sizes = ", ".join(str(g.n_tokens) for g in runner.graphs.prefill) or "none"
        print(
            f"[{name}] CUDA graphs captured at load in {runner.loaded.graph_capture_s * 1e3:.0f} ms (decode step; "
            f"prefill steps of {sizes} tokens)",
            flush=True,
        )
        time_engine(runner, toks[:256], 4)  # warm-up: kernel compilation, cuBLAS handles
        hf = None
        if not args.no_hf:
            try:
                hf = hf_model(Path(path), args.dtype)
                time_hf(hf, toks[:256], 4)
            except Exception as e:  # noqa: BLE001 - report, keep the engine figures
                print(f"[{name}] transformers not run: {type(e).__name__}: {e}", flush=True)
                hf = None
        for n in lengths:
            # best of --repeat runs each (the first run at a new length also pays one-time costs:
            # transformers' mask and kernel selection, CuPy's kernel cache for new shapes)
            runs = [time_engine(runner, toks[:n], args.decode) for _ in range(args.repeat)]
            e = min(runs, key=_total)
            e["first_prefill_s"] = runs[0]["prefill_s"]
            h = None
            if hf is not None:
                h = min((time_hf(hf, toks[:n], args.decode) for _ in range(args.repeat)), key=_total)
            row = {"model": name, "dtype": args.dtype, "n_prompt": n, "engine": e, "hf": h}
            rows.append(row)
            pf, dc = n / e["prefill_s"], args.decode / e["decode_s"]
            tg, gd = args.decode / e["tg_s"], args.decode / e["greedy_s"]
            graphs = "graph" if e["decode_graph"] else "eager"
            peer = peers.get(name, {}).get(n)
            row["peer_decode"] = peer
            # Prefill steps replay the graphs captured at load (padded to the next size).
            chunked = (f" ({e['prefill_graph_replays']} graph replays; 1st run {n / e['first_prefill_s']:.0f} tok/s)"
                       if e["prefill_graph_replays"] else "")  # fmt: skip
            line = (f"{name:8s} {args.dtype} L={n:6d}  engine prefill {pf:9.0f} tok/s{chunked}  decode {dc:7.1f} tok/s "
                    f"({graphs}; host argmax), {tg:7.1f} (logits to host, none sampled), {gd:7.1f} (greedy on the device)")  # fmt: skip
            if peer:
                line += f" | llama.cpp tg at {n} held {peer:7.1f} tok/s: x{tg / peer:.2f} / x{gd / peer:.2f}"
            if h:
                hpf, hdc = n / h["prefill_s"], args.decode / h["decode_s"]
                line += (f" | transformers prefill {hpf:9.0f} tok/s  decode {hdc:7.1f} tok/s"
                         f" | ratio prefill x{pf / hpf:.2f} decode x{dc / hdc:.2f}"
                         f" | first token {'same' if e['first_token'] == h['first_token'] else 'DIFFERENT'}")  # fmt: skip
            print(line, flush=True)
        del runner, hf
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
