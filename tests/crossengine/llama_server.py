"""llama.cpp's own server in-process (xllamacpp: llama.cpp b11549), driven over HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import xllamacpp as xlc

FLASH_ATTN = {"v_trans": "LLAMA_FLASH_ATTN_TYPE_DISABLED", "v_rows": "LLAMA_FLASH_ATTN_TYPE_ENABLED"}


class LlamaServer:
    """llama-server in this process: HTTP on an ephemeral port, one slot, slot files in `slots`."""

    def __init__(
        self,
        model: Path,
        slots: Path,
        flash_attn: str,
        kv_type: str = "GGML_TYPE_F16",
        threads: int = 2,
        **settings: object,
    ) -> None:
        """`settings`: more of llama.cpp's common_params, by name (chat_template, use_jinja, ...)."""
        p = xlc.CommonParams()
        p.cache_type_k = p.cache_type_v = getattr(xlc.ggml_type, kv_type)
        p.model.path = str(model)
        p.n_parallel = 1
        p.n_ctx = 2048
        p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
        p.port = 0
        p.slot_save_path = str(slots) + "/"  # llama-server joins it to the file name as text
        p.flash_attn_type = getattr(xlc.llama_flash_attn_type, flash_attn)
        for name, value in settings.items():
            setattr(p, name, value)
        self.slots = slots
        self.server = xlc.Server(p)
        self.base = self.server.listening_address
        deadline = time.monotonic() + 120
        while True:
            try:
                self.get("/health")
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=300) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, **json.loads(exc.read() or b"{}")}

    def tokenize(self, text: str) -> list[int]:
        return self.post("/tokenize", {"content": text, "add_special": True})["tokens"]

    def complete(self, tokens: list[int], n: int, n_probs: int = 0, **more: object) -> dict:
        """Greedy completion of a token prompt in slot 0, reusing what the slot holds (`more`: other fields of
        the request, logit_bias, ignore_eos, ...)."""
        return self.post(
            "/completion",
            {
                "prompt": tokens,
                "n_predict": n,
                "temperature": 0,
                "top_k": 1,
                "cache_prompt": True,
                "id_slot": 0,
                "return_tokens": True,
                "samplers": ["top_k"],
                "n_probs": n_probs,
                **more,
            },
        )
