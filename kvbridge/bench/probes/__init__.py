"""Research probes: one-off measurements and robustness runs, each `python -m kvbridge.bench.probes.<name>`.

None is a command of `kvbridge`; each answered a question whose figures are in Docs/Research.md:
- layout_probe: does an answer depend on where its cells lie in llama.cpp's unified KV cache;
- checksum_bench: what a checksum of each shared-memory object read would cost against the copy;
- blend_bench: blend's quality and cost curve (recomputed tokens per passage, passages, shifts);
- tenant_bench / tenant_timing: tenants' TTFTs, and the timing side channel between tenants;
- fault_soak: engines answering while their servers are killed and paused (tests/test_fault_soak.py);
- protocol_fuzz and squatter: hostile messages against the cache server, and a server squatting its port.
- zoo_doc_qa: Document Q&A on the bench-size zoo, every answer and its logits against cold, in-process and
  from L2 in a fresh process (Research §30).
"""
