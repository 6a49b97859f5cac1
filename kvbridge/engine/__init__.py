"""The engine layer: CachedEngine runs the flow and records what each request cost.

prompt -> tokens -> chunk hashes (hashing) under a namespace (namespace) -> lookup and restore of
chunk and tail objects (chunks) -> suffix prefill and generation by a Backend -> store; each
request becomes a RequestRecord (records), counters and timings go to Metrics (metrics). How a request
runs is its mode's (modes: the exact prefix modes built in, others registered from above, as blend).
"""
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.engine.metrics import Metrics
from kvbridge.engine.modes import mode_names
from kvbridge.engine.records import RequestRecord

__all__ = ["CachedEngine", "Metrics", "RequestRecord", "mode_names"]
