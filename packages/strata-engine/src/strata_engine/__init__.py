"""strata-engine: a reference GGUF inference engine on NumPy (CPU) and CuPy (GPU).

Modules: `gguf` (lean reader, dequantization), `config` (ModelConfig), `ops` (the `Ops` interface and its
numpy / cupy backends), `models` (one module per family), `embedding` (EMBED), `kv` (the K/V pools, rings, placements,
checkpoints), `runner` (ModelRunner: prefill with prompt cache, decode, erase), `session` (the session
file adapter and its verbs), `protocol` (the engine protocol's vocabulary, registry and loop), `serve`
(the verbs on it), `completion` (the generation loop), `sampling` (the sampler chain), `constraints`
(structured output with llguidance), `settings` (and the vocabularies: K/V types, compute dtypes,
backends), `errors`.
"""

import os

# OpenBLAS's threads spin ~0.1 s after each call before they sleep; the numba kernels that follow a
# prefill's BLAS products then share the cores with them (decode fell several-fold). Read when numpy
# loads OpenBLAS, so it takes effect where the engine is imported first (its own process).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
