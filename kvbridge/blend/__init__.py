"""Blend mode: reuse a retrieved passage's KV wherever it stands in the prompt (LMCache's CacheBlend idea).

    engine.infer("Answer from the passages.[KVB_SEP]passage one[KVB_SEP]passage two[KVB_SEP]Question?", mode="blend")

A prompt's segments (instruction, passages, question; tokenized the same way in every mode) are
cut by kvbridge.engine.segments. Modules here, in reading order: passages (how a passage's KV is
keyed and stored), runner (placing stored passages at new positions, recomputing a few tokens of
each, storing new ones after the answer), result (what a placement left and what an answer cost),
mode (blend as an engine mode: registered with kvbridge.engine.modes, it runs a blend request on a
CachedEngine). CachedEngine (through the mode) and the scheduler make a runner on first use.
Blended KV is approximate: it has its own namespace and record mode, and it is never the default.
"""
