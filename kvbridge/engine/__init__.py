"""The engine layer: CachedEngine runs the flow and records what each request cost.

prompt -> tokens -> chunk hashes (hashing) under a namespace (namespace) -> lookup and restore of
chunk and tail objects (chunks) -> suffix prefill and generation by a Backend -> store; each
request becomes a RequestRecord (records), counters and timings go to Metrics (metrics).
"""
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.engine.metrics import Metrics
from kvbridge.engine.records import MODES, RequestRecord

__all__ = ["CachedEngine", "MODES", "Metrics", "RequestRecord"]
