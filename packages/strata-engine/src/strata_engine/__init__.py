"""strata-engine: a reference GGUF inference engine on NumPy (CPU), structured for a CuPy backend.

Modules: `gguf` (lean reader, dequantization), `config` (ModelConfig), `ops` (the numeric operations,
one `xp`-generic set), `models` (one module per family), `kv` (the K/V pool, rings, placement,
checkpoints), `runner` (ModelRunner: prefill with prompt cache, decode, erase), `settings`, `errors`.
"""

__version__ = "0.1.0"
