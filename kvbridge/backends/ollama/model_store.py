"""Find an Ollama model's GGUF in Ollama's model store, so KVBridge can read its real vocabulary.

Place in the flow: the Ollama shadow engine tokenizes with the very vocabulary Ollama evaluates
(chunk hashes then cover the tokens Ollama really sees), and the in-process llamacpp engine can run
an Ollama model with full KV (KVB_ENGINE=llamacpp + KVB_OLLAMA_MODEL, no KVB_MODEL_PATH).

Store layout (KVB_OLLAMA_MODELS, default ~/.ollama/models):
    manifests/<host>/<namespace>/<name>/<tag>   JSON; layers[] with mediaType and digest
    blobs/sha256-<hex>                          content-addressed files; the model layer is the GGUF
"llama3.2" means registry.ollama.ai/library/llama3.2:latest; "user/name" and "host/ns/name:tag" too.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
_DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class OllamaModelFile:
    """Where an Ollama model's GGUF lies, and the manifest that named it."""

    gguf_path: Path
    manifest_path: Path
    manifest_digest: str   # "sha256:<hex>" of the manifest file: what Ollama's /api/tags reports


def manifest_relpath(model_name: str) -> Path:
    """"name[:tag]" -> manifests-relative path host/namespace/name/tag."""
    name = model_name.strip()
    last = name.rsplit("/", 1)[-1]
    tag = DEFAULT_TAG
    if ":" in last:  # a ':' before the last '/' is a registry port, not a tag
        name, tag = name.rsplit(":", 1)
    parts = [p for p in name.split("/") if p]
    if not parts or not tag or any(p in (".", "..") for p in parts + [tag]):
        raise ValueError(f"not an Ollama model name: {model_name!r}")
    if len(parts) == 1:
        parts = [DEFAULT_REGISTRY, DEFAULT_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [DEFAULT_REGISTRY, *parts]
    return Path(*parts, tag)


def _model_layer_digest(manifest: dict) -> tuple[str, int | None] | None:
    for layer in manifest.get("layers") or []:
        if isinstance(layer, dict) and layer.get("mediaType") == MODEL_MEDIA_TYPE:
            size = layer.get("size")
            return str(layer.get("digest", "")), size if isinstance(size, int) else None
    return None


def locate_ollama_model(models_dir: str | Path, model_name: str) -> OllamaModelFile | None:
    """The model's GGUF and manifest, or None (with the reason logged) when the store lacks it."""
    if not model_name or not model_name.strip():
        return None
    root = Path(models_dir).expanduser()
    try:
        manifest_path = root / "manifests" / manifest_relpath(model_name)
    except ValueError as err:
        log.warning("%s (KVB_OLLAMA_MODEL)", err)
        return None
    try:
        raw = manifest_path.read_bytes()
        manifest = json.loads(raw)
    except FileNotFoundError:
        log.info("no Ollama manifest for %r at %s", model_name, manifest_path)
        return None
    except (OSError, ValueError) as err:
        log.warning("unreadable Ollama manifest %s: %s", manifest_path, err)
        return None
    layer = _model_layer_digest(manifest) if isinstance(manifest, dict) else None
    if layer is None:
        log.warning("Ollama manifest %s has no %s layer", manifest_path, MODEL_MEDIA_TYPE)
        return None
    digest, size = layer
    match = _DIGEST_RE.match(digest)
    if not match:
        log.warning("Ollama manifest %s names a malformed model digest %r", manifest_path, digest)
        return None
    blob = root / "blobs" / f"sha256-{match.group(1)}"
    if not blob.is_file():
        log.warning("Ollama manifest %s names blob %s, which is missing", manifest_path, blob)
        return None
    if size is not None and blob.stat().st_size != size:
        log.warning("Ollama blob %s is %d bytes, its manifest says %d", blob, blob.stat().st_size, size)
        return None
    return OllamaModelFile(blob, manifest_path, "sha256:" + hashlib.sha256(raw).hexdigest())


def find_ollama_gguf(models_dir: str | Path, model_name: str) -> Path | None:
    """The GGUF file Ollama runs for `model_name`, or None when the store does not hold it."""
    found = locate_ollama_model(models_dir, model_name)
    return found.gguf_path if found else None
