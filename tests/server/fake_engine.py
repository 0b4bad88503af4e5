"""A small fake of ``strata-engine serve`` speaking spec/engine-protocol.md, for the server's tests.

Usable in-process (``FakeEngine.handle(line)`` yields answer lines as dicts) and as a child process
(``python fake_engine.py --model FILE [...]``), where it reads stdin and writes stdout like the real
engine. Its "model" is a byte-level tokenizer (id = byte + 3; BOS 1 ``<|im_start|>``, EOS 2
``<|im_end|>``) and a deterministic next-token rule over the held tokens, so prompt-cache reuse,
greedy reproducibility, stop strings and save/restore can be checked exactly. Its session file is
JSON with a checksum; it refuses (before any change) files that are missing, links, corrupt, from
another "model" or context size, and fail-stops (exit 4) on a file marked ``"fail_after_gate"``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator

from strata_engine.errors import InvalidRequest
from strata_engine.protocol import PROTOCOL_VERSION, ErrorKind, ExitStatus, error_payload
from strata_engine.wire import VERBS, arguments

BOS, EOS = 1, 2
FIM_PRE, FIM_SUF, FIM_MID = 259, 260, 261  # reported by the ready line only with fim=True
SPECIALS = {
    "<|im_start|>": BOS,
    "<|im_end|>": EOS,
    "<fim_prefix>": FIM_PRE,
    "<fim_suffix>": FIM_SUF,
    "<fim_middle>": FIM_MID,
}
N_VOCAB = 300
N_EMBD = 8
POOLINGS = ("none", "mean", "cls", "last")
ALPHABET = "abcdefghij klmnop\n"
MAGIC = "FAKE-STRATA-SESSION"
FAKE_ENGINE_PATH = os.path.abspath(__file__)


class FailStop(Exception):
    pass


def tokenize(text: str, parse_special: bool = True) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(text):
        if parse_special:
            match = next((s for s in SPECIALS if text.startswith(s, i)), None)
            if match:
                out.append(SPECIALS[match])
                i += len(match)
                continue
        out.extend(b + 3 for b in text[i].encode("utf-8"))
        i += 1
    return out


def piece_bytes(token: int) -> bytes:
    for text, tid in SPECIALS.items():
        if tid == token:
            return text.encode()
    return bytes([token - 3]) if 3 <= token < 259 else b""


def detokenize(tokens: list[int]) -> str:
    return b"".join(piece_bytes(t) for t in tokens).decode("utf-8", errors="replace")


def next_candidates(held: list[int]) -> list[tuple[int, float]]:
    """Top candidates with log-probabilities: a deterministic function of the last 4 held tokens."""
    digest = hashlib.blake2b(bytes(t % 256 for t in held[-4:]), digest_size=8).digest()
    first = digest[0] % len(ALPHABET)
    cands = [(tokenize(ALPHABET[(first + k) % len(ALPHABET)])[0], -0.2 - k) for k in range(4)]
    if digest[1] % 40 == 0:
        cands.insert(0, (EOS, -0.1))
    return cands


def greedy_ends_at_eos(prompt: list[int], n_predict: int) -> bool:
    """Whether a greedy generation from `prompt` reaches EOS within n_predict tokens (the rule above)."""
    seq = list(prompt)
    for _ in range(n_predict):
        token = next_candidates(seq)[0][0]
        if token == EOS:
            return True
        seq.append(token)
    return False


def token_state(prefix: list[int]) -> list[float]:
    """A token's "hidden state": a deterministic function of the tokens up to it (causal, as the model's)."""
    digest = hashlib.blake2b(json.dumps(prefix[-8:] + [len(prefix)]).encode(), digest_size=N_EMBD).digest()
    return [b / 255.0 - 0.5 for b in digest]


def normalized(v: list[float], p: int) -> list[float]:
    """llama-server's embd_normalize: -1 none, 0 max absolute over int16's range, 2 euclidean, else p-norm."""
    if p == -1:
        norm = 1.0
    elif p == 0:
        norm = max(map(abs, v)) / 32760.0
    else:
        norm = sum(abs(x) ** p for x in v) ** (1.0 / p)
    return [x / norm if norm > 0 else 0.0 for x in v]


class FakeEngine:
    def __init__(
        self,
        model_path: str,
        n_ctx: int = 512,
        kv_type: str = "f16",
        token_delay: float = 0.0,
        prompt_delay: float = 0.0,
        fim: bool = False,
        n_slots: int = 1,
    ) -> None:
        self.model_path = model_path
        with open(model_path, encoding="utf-8") as f:
            self.model_name = f.read().strip() or "fake"
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self.token_delay = token_delay
        self.prompt_delay = prompt_delay
        self.fim = fim
        self.n_slots = n_slots  # the ready line's; one FakeEngine holds one slot's conversation
        self.held: list[int] = []
        self.fail_saves = False  # tests: every SAVE fails before its rename (disk full)
        self.cancel_requested: Callable[[], bool] = lambda: False
        self.n_forward = (
            0  # its "forward passes": one per prompt, per generated token but the last, per EMBED
        )

    def ready_line(self) -> dict:
        return {
            "event": "ready",
            "protocol": PROTOCOL_VERSION,
            "engine": "fake-engine",
            "engine_version": "0.0.1",
            "model_path": self.model_path,
            "model_name": self.model_name,
            "architecture": "fake",
            "n_ctx": self.n_ctx * self.n_slots,
            "n_slots": self.n_slots,
            "n_ctx_slot": self.n_ctx,
            "n_ctx_train": 512,
            "n_vocab": N_VOCAB,
            "n_layer": 2,
            "n_embd": 8,
            "n_params": 1000,
            "model_size": 4000,
            "backend": "python",
            "kv_type": self.kv_type,
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "eog_tokens": [EOS],
            "chat_template": "chatml",
            "add_bos": False,
            "prompt_cache": True,
            "pooling": "none",
            "fim_tokens": {
                "pre": FIM_PRE if self.fim else None,
                "suf": FIM_SUF if self.fim else None,
                "mid": FIM_MID if self.fim else None,
                "pad": None,
                "rep": None,
                "sep": None,
            },
        }

    # --- dispatch ---------------------------------------------------------------------------------

    def handle(self, line: str) -> Iterator[dict]:
        """The lines answering one command line; its object as the engine's wire layer reads it."""
        verb, _, argument = line.partition(" ")
        handler = getattr(self, f"do_{verb.lower()}", None) if verb in VERBS else None
        if handler is None:
            yield self.error(ErrorKind.INVALID_REQUEST, f"unknown verb {verb!r}")
            return
        try:
            arg = arguments(VERBS[verb].arguments, json.loads(argument) if argument else {})
        except ValueError as exc:
            yield self.error(ErrorKind.INVALID_REQUEST, f"bad JSON: {exc}")
            return
        except InvalidRequest as exc:
            yield {"event": "error", "error": error_payload(exc)}
            return
        yield from handler(arg)

    @staticmethod
    def error(kind: ErrorKind, message: str, **extra) -> dict:
        return {"event": "error", "error": {"type": kind, "message": message, **extra}}

    # --- verbs ------------------------------------------------------------------------------------

    def do_tokenize(self, arg) -> Iterator[dict]:
        tokens = tokenize(arg.content, arg.parse_special)
        if arg.add_special:
            tokens = [BOS, *tokens]
        if arg.with_pieces:
            pieces = []
            for t in tokens:
                raw = piece_bytes(t)
                try:
                    pieces.append({"id": t, "piece": raw.decode("utf-8")})
                except UnicodeDecodeError:
                    pieces.append({"id": t, "piece": list(raw)})
            tokens = pieces
        yield {"event": "result", "tokens": tokens}

    def do_embed(self, arg) -> Iterator[dict]:
        """Pooled and normalized as the engine's EMBED; the held conversation untouched."""
        tokens, pooling, p = arg.tokens, arg.pooling or "none", arg.normalize
        if not tokens:
            yield self.error(ErrorKind.INVALID_REQUEST, f"bad EMBED argument {arg!r}")
            return
        if len(tokens) > self.n_ctx:
            yield self.error(
                ErrorKind.EXCEED_CONTEXT_SIZE, "input too long", n_prompt_tokens=len(tokens), n_ctx=self.n_ctx
            )
            return
        states = [token_state(tokens[: i + 1]) for i in range(len(tokens))]
        pooled = {
            "none": states,
            "mean": [[sum(col) / len(states) for col in zip(*states, strict=True)]],
            "cls": states[:1],
            "last": states[-1:],
        }[pooling]
        rows = pooled if pooling == "none" else [normalized(row, p) for row in pooled]
        self.n_forward += 1
        yield {"event": "result", "embedding": rows, "n_tokens": len(tokens)}

    def do_detokenize(self, arg) -> Iterator[dict]:
        yield {"event": "result", "content": detokenize(arg.tokens)}

    def do_apply_template(self, arg) -> Iterator[dict]:
        yield {"event": "result", "prompt": self.render_command(arg)}

    @classmethod
    def render_command(cls, arg) -> str:
        """ChatML, with the protocol's add_generation_prompt and continue_final_message (None: the default)."""
        if arg.continue_final_message:
            return cls.render(arg.messages[:-1]) + arg.messages[-1]["content"]
        return cls.render(arg.messages, arg.add_generation_prompt is not False)

    @staticmethod
    def render(messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def slot_status(self, slot: int, busy: bool = False) -> dict:
        return {
            "slot": slot,
            "n_ctx": self.n_ctx,
            "n_past": len(self.held),
            "n_tokens_held": len(self.held),
            "tokens_held_digest": hashlib.sha256(json.dumps(self.held).encode()).hexdigest()[:16],
            "is_processing": busy,
        }

    def do_status(self, arg) -> Iterator[dict]:
        yield status_of([self])

    def do_erase(self, arg) -> Iterator[dict]:
        n = len(self.held)
        self.held = []
        yield {"event": "result", "n_erased": n}

    def do_cancel(self, arg) -> Iterator[dict]:
        """Outside a COMPLETE a CANCEL is ignored: no answer line (spec/engine-protocol.md)."""
        yield from ()

    def do_quit(self, arg) -> Iterator[dict]:
        yield {"event": "result"}
        raise SystemExit(0)

    def do_complete(self, arg) -> Iterator[dict]:
        prompt = self.prompt_of(arg)
        if not prompt:
            yield self.error(ErrorKind.INVALID_REQUEST, "empty prompt")
            return
        if len(prompt) >= self.n_ctx:
            yield self.error(
                ErrorKind.EXCEED_CONTEXT_SIZE,
                "prompt too long",
                n_prompt_tokens=len(prompt),
                n_ctx=self.n_ctx,
            )
            return
        cache_n = 0
        if arg.cache_prompt is not False:
            while cache_n < min(len(prompt) - 1, len(self.held)) and prompt[cache_n] == self.held[cache_n]:
                cache_n += 1
        t0 = time.perf_counter()
        if self.prompt_delay:
            time.sleep(self.prompt_delay)
        prompt_ms = (time.perf_counter() - t0) * 1000 + 0.01
        if arg.return_progress:
            yield {
                "event": "progress",
                "phase": "prompt",
                "total": len(prompt),
                "cache": cache_n,
                "processed": len(prompt),
                "time_ms": prompt_ms,
            }
        seq = list(prompt)
        self.held = list(prompt)
        n_predict = -1 if arg.n_predict is None else arg.n_predict
        temperature = 0.8 if arg.temperature is None else arg.temperature
        n_probs = arg.n_probs or 0
        rng = random.Random(arg.seed if arg.seed not in (None, -1) else None)
        stops = arg.stop or ()
        generated: list[int] = []
        text = ""
        released = 0
        stop_type, stopping_word = "limit", ""
        t1 = time.perf_counter()
        while True:
            if n_predict >= 0 and len(generated) >= n_predict:
                break
            if len(seq) >= self.n_ctx:
                break
            if self.cancel_requested():
                stop_type = "cancelled"
                break
            if self.token_delay:
                time.sleep(self.token_delay)
            cands = next_candidates(seq)
            if temperature <= 0:
                token = cands[0][0]
            else:
                token = rng.choice(cands[:3])[0]
            if token == EOS and not arg.ignore_eos:
                generated.append(token)
                stop_type = "eos"
                yield {"event": "token", "token": token, "piece": "<|im_end|>", "content": ""}
                break
            generated.append(token)
            seq.append(token)
            text = detokenize([t for t in generated if t != EOS])
            cut = next((text.index(s) for s in stops if s in text), None)
            if cut is not None:
                stopping_word = next(s for s in stops if s in text)
                stop_type = "word"
                text = text[:cut]
                content = text[released:]
                released = len(text)
                yield {
                    "event": "token",
                    "token": token,
                    "piece": piece_bytes(token).decode("utf-8", "replace"),
                    "content": content,
                }
                break
            hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            safe = len(text) - hold
            content = text[released:safe] if safe > released else ""
            released = max(released, safe)
            event = {
                "event": "token",
                "token": token,
                "piece": piece_bytes(token).decode("utf-8", "replace"),
                "content": content,
            }
            if n_probs:
                chosen = dict(cands).get(token, -9.0)
                event |= {"logprob": chosen, "prob": 2.718281828**chosen, "bytes": list(piece_bytes(token))}
                event["probs"] = [
                    {
                        "id": t,
                        "token": detokenize([t]),
                        "bytes": list(piece_bytes(t)),
                        "logprob": lp,
                        "prob": 2.718281828**lp,
                    }
                    for t, lp in cands[:n_probs]
                ]
            yield event
        # The last sampled token is never evaluated, so it is not held (as the real engine).
        self.held = prompt + generated[:-1]
        predicted_ms = (time.perf_counter() - t1) * 1000 + 0.01
        n_gen = len(generated)
        self.n_forward += 1 + max(n_gen - 1, 0)
        yield {
            "event": "result",
            "content": text if stop_type != "cancelled" else text[:released],
            "tokens": generated,
            "stop_type": stop_type,
            "stopping_word": stopping_word,
            "truncated": False,
            "tokens_evaluated": len(prompt),
            "tokens_cached": len(self.held),
            "n_tokens_held": len(self.held),
            # no batching here: a step for the prompt and one per generated token but the last, each its own
            "n_steps": 1 + max(n_gen - 1, 0),
            "step_share": float(1 + max(n_gen - 1, 0)),
            "timings": {
                "cache_n": cache_n,
                "prompt_n": len(prompt) - cache_n,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(len(prompt) - cache_n, 1),
                "prompt_per_second": 1000 * (len(prompt) - cache_n) / prompt_ms,
                "predicted_n": n_gen,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(n_gen, 1),
                "predicted_per_second": 1000 * n_gen / predicted_ms,
            },
        }

    def do_prompt_tokens(self, arg) -> Iterator[dict]:
        prompt = self.prompt_of(arg)
        if len(prompt) >= self.n_ctx:
            yield self.error(
                ErrorKind.EXCEED_CONTEXT_SIZE,
                "prompt too long",
                n_prompt_tokens=len(prompt),
                n_ctx=self.n_ctx,
            )
            return
        yield {"event": "result", "tokens": prompt}

    def prompt_of(self, arg) -> list[int]:
        if arg.messages is not None:
            return tokenize(self.render_command(arg))
        if isinstance(arg.prompt, str):
            return tokenize(arg.prompt)
        prompt = []
        for item in arg.prompt:
            prompt += tokenize(item) if isinstance(item, str) else [item]
        return prompt

    def do_save(self, arg) -> Iterator[dict]:
        path = arg.path
        t0 = time.perf_counter()
        body = {
            "magic": MAGIC,
            "model": self.model_name,
            "n_ctx": self.n_ctx,
            "kv_type": self.kv_type,
            "tokens": self.held,
        }
        body["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        data = json.dumps(body).encode()
        # A short temporary name: the target's own name may already be 255 bytes long.
        tmp = os.path.join(os.path.dirname(path), f".strata-tmp-{os.getpid()}-{random.getrandbits(32):08x}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.fail_saves:
                    raise OSError(28, "No space left on device")
            yield {"event": "progress", "phase": "copy", "bytes_done": len(data), "bytes_total": len(data)}
            os.replace(tmp, path)
        except OSError as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            yield self.error(
                ErrorKind.SESSION_WRITE_FAILED, f"cannot write {path}: {exc.strerror}", reason="io_error"
            )
            return
        yield {
            "event": "result",
            "n_saved": len(self.held),
            "n_written": len(data),
            "save_ms": (time.perf_counter() - t0) * 1000,
        }

    def do_restore(self, arg) -> Iterator[dict]:
        path = arg.path
        t0 = time.perf_counter()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            yield self.error(ErrorKind.SESSION_REFUSED, f"no such file: {path}", reason="not_found")
            return
        except OSError as exc:
            yield self.error(
                ErrorKind.SESSION_REFUSED, f"cannot open {path}: {exc.strerror}", reason="not_regular_file"
            )
            return
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        try:
            body = json.loads(data)
            checksum = body.pop("checksum")
        except (ValueError, KeyError, AttributeError, TypeError):
            yield self.error(ErrorKind.SESSION_REFUSED, "not a session file", reason="corrupt")
            return
        fail_after_gate = body.pop("fail_after_gate", None)
        if (
            body.get("magic") != MAGIC
            or hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() != checksum
        ):
            yield self.error(ErrorKind.SESSION_REFUSED, "checksum mismatch", reason="corrupt")
            return
        if body["model"] != self.model_name:
            yield self.error(
                ErrorKind.SESSION_REFUSED, f"written by model {body['model']!r}", reason="model_mismatch"
            )
            return
        if body["n_ctx"] != self.n_ctx or body["kv_type"] != self.kv_type:
            yield self.error(
                ErrorKind.SESSION_REFUSED, "written with other settings", reason="config_mismatch"
            )
            return
        if fail_after_gate:
            self.held = []
            if fail_after_gate == "fail_stop":  # erasing the slot failed too: the engine exits 4
                raise FailStop("apply pass failed after the first block, and so did erasing the slot")
            yield self.error(
                ErrorKind.SLOT_FAILED,
                "apply pass failed after the first block; the slot was erased",
                reason="apply_failed",
            )
            return
        self.held = list(body["tokens"])
        yield {
            "event": "result",
            "n_restored": len(self.held),
            "n_read": len(data),
            "restore_ms": (time.perf_counter() - t0) * 1000,
        }


def mark_fail_after_gate(path: str, fail_stop: bool = False) -> None:
    """Rewrite a fake session file so its restore passes validation and then fails: the slot erased
    (``slot_failed``), or with ``fail_stop`` the engine exiting with status 4."""
    with open(path, encoding="utf-8") as f:
        body = json.load(f)
    body.pop("checksum")
    body["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    body["fail_after_gate"] = "fail_stop" if fail_stop else "slot_failed"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(body, f)


def status_of(engines: list[FakeEngine], busy: frozenset[int] = frozenset()) -> dict:
    """STATUS of an engine whose slot i is ``engines[i]`` (protocol v2: one entry per slot)."""
    first = engines[0]
    return {
        "event": "result",
        "n_ctx": first.n_ctx * len(engines),
        "n_slots": len(engines),
        "n_ctx_slot": first.n_ctx,
        "is_processing": bool(busy),
        "kv_type": first.kv_type,
        "backend": "python",
        "model_path": first.model_path,
        "slots": [e.slot_status(i, i in busy) for i, e in enumerate(engines)],
    }


def main(argv: list[str] | None = None) -> int:
    """``strata-engine serve`` as a fake speaking protocol v2: every command on a thread of its own (so
    TOKENIZE answers while a COMPLETE streams), lines tagged with the command's id and slot, a slot busy
    with a COMPLETE refusing other slot commands, CANCEL by id."""
    parser = argparse.ArgumentParser()
    parser.add_argument("serve", nargs="?")
    parser.add_argument("--model", required=True)
    parser.add_argument("--ctx-size", type=int, default=512)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--kv-type", default="f16")
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--prompt-delay", type=float, default=0.0)
    parser.add_argument("--load-delay", type=float, default=0.0)
    parser.add_argument("--fail-load", action="store_true")
    parser.add_argument("--protocol", type=int, default=PROTOCOL_VERSION)
    parser.add_argument("--pid-file")
    args = parser.parse_args(argv)
    out = sys.stdout
    out_lock = threading.Lock()

    def emit(event: dict) -> None:
        with out_lock:
            out.write(json.dumps(event) + "\n")
            out.flush()

    if args.pid_file:
        with open(args.pid_file, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
    time.sleep(args.load_delay)
    if args.fail_load or not os.path.isfile(args.model):
        emit({"event": "fatal", "message": f"cannot load model {args.model}"})
        return ExitStatus.MODEL_LOAD
    n_ctx_slot = args.ctx_size // args.parallel
    engines = [
        FakeEngine(
            args.model, n_ctx_slot, args.kv_type, args.token_delay, args.prompt_delay, n_slots=args.parallel
        )
        for _ in range(args.parallel)
    ]
    tools = FakeEngine(args.model, n_ctx_slot, args.kv_type, n_slots=args.parallel)  # slot-less verbs
    lock = threading.Lock()
    busy: dict[int, str | None] = {}  # slot -> the id of the COMPLETE holding it
    cancelled: set[str] = set()
    running: list[threading.Thread] = []
    ready = tools.ready_line()
    ready["protocol"] = args.protocol
    emit(ready)

    def run(verb: str, line: str, tags: dict, engine: FakeEngine, slot: int | None) -> None:
        request_id = tags.get("id")
        release = release_of(slot, request_id)
        if verb == "COMPLETE":
            engine.cancel_requested = lambda: request_id in cancelled
        try:
            for event in engine.handle(line):
                if event["event"] in ("result", "error") and verb in ("COMPLETE", "EMBED"):
                    # the engine's count of forward passes since start-up, every slot's and the EMBEDs'
                    event = {**event, "n_forward": sum(e.n_forward for e in [*engines, tools])}
                if event["event"] in ("result", "error") and slot is not None:
                    event = {**event, "slot": slot}
                    if verb == "COMPLETE":  # idle from its terminal line on, as the engine's slots
                        release()
                emit({**event, **tags})
        except FailStop as exc:
            emit(
                {
                    "event": "error",
                    **tags,
                    "error": {"type": ErrorKind.FAIL_STOP, "reason": "apply_failed", "message": str(exc)},
                }
            )
            os._exit(ExitStatus.FAIL_STOP)
        finally:
            if verb == "COMPLETE" and slot is not None:
                release()

    def release_of(slot: int | None, request_id: str | None) -> Callable[[], None]:
        def release() -> None:
            with lock:
                if slot is not None and busy.get(slot, "") == request_id:
                    busy.pop(slot)
                cancelled.discard(request_id or "")

        return release

    lines: queue.Queue = queue.Queue()

    def read_stdin() -> None:
        for raw in sys.stdin:
            lines.put(raw.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    while True:
        line = lines.get()
        if line is None or line.split(" ", 1)[0] == "QUIT":
            for thread in running:
                thread.join()
            if line is not None:
                arg = json.loads(line.partition(" ")[2] or "{}")
                emit({"event": "result", **({"id": arg["id"]} if "id" in arg else {})})
            return ExitStatus.CLEAN
        verb, _, argument = line.partition(" ")
        try:
            arg = json.loads(argument) if argument else {}
        except ValueError:
            emit(FakeEngine.error(ErrorKind.INVALID_REQUEST, "bad JSON", reason="bad_json"))
            continue
        tags = {"id": arg["id"]} if "id" in arg else {}
        if verb == "CANCEL":
            with lock:
                if arg.get("id") in busy.values():
                    cancelled.add(arg["id"])
            continue
        if verb == "STATUS":
            with lock:
                emit({**status_of(engines, frozenset(busy)), **tags})
            continue
        slot = None
        engine = tools
        if verb in VERBS and VERBS[verb].slotted:
            slot = int(arg.get("slot", 0))
            with lock:
                if slot in busy:
                    emit(
                        {
                            **FakeEngine.error(
                                ErrorKind.SLOT_BUSY, f"slot {slot} is busy", reason="slot_busy"
                            ),
                            "slot": slot,
                            **tags,
                        }
                    )
                    continue
                if verb == "COMPLETE":
                    busy[slot] = arg.get("id")
            engine = engines[slot]
        thread = threading.Thread(target=run, args=(verb, line, tags, engine, slot), daemon=True)
        running[:] = [t for t in running if t.is_alive()] + [thread]
        thread.start()


if __name__ == "__main__":
    sys.exit(main())
