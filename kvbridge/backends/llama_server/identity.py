"""What a llama-server says about the model it runs: the namespace's model identity when the file is elsewhere.

Place in the flow: LlamaServerBackend.start() -> `GET /props`, `GET /v1/models` -> **server_identity()**
-> kv_fingerprint() -> CachedEngine's namespace. A model file on this machine is identified by its
sha256 (CachedEngine hashes it). A model on another machine only by what its server reports: the
path, the parameter count, the tensor bytes, the vocabulary, the training context, the file type,
and the server's build and context settings. A server that reports too little to tell one model from
another gets a namespace of its own for this attachment (`run`), so its objects are never restored
into another model.

What llama-server (llama-cpp-python 0.3.36's tree, tools/server/server-context.cpp) reports:
`/props` model_path, model_ftype, build_info, total_slots, default_generation_settings.n_ctx (no
cache types); `/v1/models` data[0].meta: vocab_type, n_vocab, n_ctx, n_ctx_train, n_embd, n_params,
size, ftype. Nothing in either changes when the server restarts (`created` is the time of the
answer), so an unidentified server's namespace carries a nonce chosen when KVBridge attaches.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

# /v1/models meta fields that describe the model itself (n_ctx is the server's setting, read from /props)
MODEL_META_KEYS = ("n_params", "size", "n_vocab", "n_ctx_train", "n_embd", "vocab_type", "ftype")
# without these two a quantisation or a different model of one architecture cannot be told apart
IDENTIFYING_KEYS = ("n_params", "size")
# /props fields that are the server's own settings; cache types only where a server reports them
SERVER_KEYS = ("total_slots", "cache_type_k", "cache_type_v")


@dataclass(frozen=True)
class ServerIdentity:
    """The model and server facts that go into the namespace of an attached llama-server."""

    facts: dict[str, str]    # everything reported, prefixed "server_" in the fingerprint
    identified: bool         # False: too little to tell models apart; `facts` then holds a per-run nonce

    def fingerprint(self) -> dict[str, str]:
        return {f"server_{key}": value for key, value in sorted(self.facts.items())}


def server_identity(address: str, props: dict, models: dict | None) -> ServerIdentity:
    """The facts `/props` and `/v1/models` report; an unidentified model gets this attachment's own nonce."""
    facts: dict[str, str] = {}
    if props.get("model_path"):
        facts["model_path"] = str(props["model_path"])
    if props.get("model_ftype"):
        facts["model_ftype"] = str(props["model_ftype"])
    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
    if n_ctx is not None:
        facts["n_ctx"] = str(n_ctx)
    for key in SERVER_KEYS:
        if props.get(key) is not None:
            facts[key] = str(props[key])
    meta = _model_meta(models)
    for key in MODEL_META_KEYS:
        if meta.get(key) is not None:
            facts[f"model_{key}"] = str(meta[key])
    identified = all(f"model_{key}" in facts for key in IDENTIFYING_KEYS)
    if not identified:
        # llama-server reports nothing that changes across its restarts: a nonce of this attachment
        # is the nearest safe thing (a reconnect, and so a restart seen by a reconnect, starts afresh)
        facts["address"] = address
        facts["build_info"] = str(props.get("build_info") or "unknown")
        facts["run"] = uuid.uuid4().hex
    return ServerIdentity(facts=facts, identified=identified)


def _model_meta(models: dict | None) -> dict:
    entries = models.get("data") if isinstance(models, dict) else None
    first = entries[0] if isinstance(entries, list) and entries else None
    meta = first.get("meta") if isinstance(first, dict) else None
    return meta if isinstance(meta, dict) else {}
