"""strata-engine: a reference GGUF inference engine on NumPy (CPU) and CuPy (GPU).

Modules: `gguf` (lean reader, dequantization), `config` (ModelConfig), `ops` (the `Ops` interface and its
numpy / cupy backends), `models` (one module per family), `embedding` (EMBED), `kv` (the K/V pools, rings, placements,
checkpoints), `loaded` (LoadedModel: weights, settings, warm-up, CUDA graphs), `runner` (ModelRunner: one slot:
prefill with prompt cache, decode, erase), `slots` (SlotSet: the slots on one model), `session` (the session
file adapter and its verbs), `protocol` (the engine protocol's vocabulary, registry and loop), `serve`
(the verbs on it), `completion` (the generation loop), `sampling` (the sampler chain), `constraints`
(structured output with llguidance), `settings` (and the vocabularies: K/V types, compute dtypes,
backends), `errors`, `process_env` (the engine process's environment: imported by entry points only).
"""

__version__ = "0.1.0"
