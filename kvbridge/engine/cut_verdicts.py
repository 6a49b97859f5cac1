"""The cut probe's verdicts, kept beside the llama.cpp build record and read when an engine opens its namespace.

Place in the flow: `kvbridge cut-probe --save` (./scripts/setup.sh runs it for the embedded models) measures where
a restore may end on this machine (kvbridge.models.cut_probe) and writes one small file here; CachedEngine
reads it (rule_for) and its restores end where that rule allows (kvbridge.engine.cold_cut.CutRule). A verdict
holds only for what the probe ran: the model file (its sha256), the llama.cpp release and its build flags, the K/V
types, flash attention, the prefill batch, the thread count and the CPU (its model name and instruction flags) —
the key below. Anything else (a llama-server of another build, a file whose checksum or key does not match) gets
DEFAULT_RULE, the fixed grid of 8, and the engine's status says so. Deliberately left out: probing on an
engine's first start (a minute of two busy cores, and restores that would change mid-run).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from kvbridge.backends.base import BATCH_TOKENS
from kvbridge.engine.cold_cut import DEFAULT_RULE, CutRule
from kvbridge.settings.build_record import build_flags
from kvbridge.settings.paths import BUILD_RECORD

log = logging.getLogger(__name__)
FORMAT = "kvbridge-cut-verdict v1"
VERDICT_DIR = BUILD_RECORD.parent / "kvbridge-cut-verdicts"


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and a digest of its instruction flags (kernels are chosen by both)."""
    name, flags = "unknown CPU", ""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{name} | flags {hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def verdict_key(settings, model_path: Path, record: Path = BUILD_RECORD) -> dict[str, str]:
    """What a verdict holds for; two equal keys run the same kernels on the same rows."""
    import llama_cpp

    from kvbridge.engine.namespace import file_sha256, sha_cache_file

    path = Path(model_path)
    return {
        "model_sha256": file_sha256(path, sha_cache_file(settings.l2_dir)),
        "model_file": path.name,
        "llama_cpp_python": llama_cpp.__version__,
        "build_flags": build_flags(record),
        "cache_type_k": settings.cache_type_k.lower(),
        "cache_type_v": settings.cache_type_v.lower(),
        "flash_attn": "on" if settings.flash_attn else "off",
        "batch_tokens": str(BATCH_TOKENS),
        "threads": str(settings.resolved_threads()),
        "cpu": cpu_identity(),
    }


# what the verdict's file name and its check leave out: the model file's name is shown, never compared (the same
# GGUF as an Ollama blob, `sha256-...`, or as a copy under another name is the same model by its sha256)
SHOWN_ONLY = ("model_file",)


def _compared(key: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in key.items() if k not in SHOWN_ONLY}


def key_digest(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(_compared(key), sort_keys=True).encode()).hexdigest()[:24]


def source_line(key: dict[str, str]) -> str:
    """Where a rule came from, for status pages."""
    return (f"proven by the cut probe for {key['model_file']}, K/V {key['cache_type_k']}/{key['cache_type_v']}, "
            f"{key['threads']} threads, verdict {key_digest(key)}")


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save(key: dict[str, str], rule: CutRule, results, seconds: float, folder: Path | None = None) -> Path:
    """Write the verdict for `key` (atomically); returns its path."""
    folder = folder or VERDICT_DIR
    body = {
        "format": FORMAT,
        "key": key,
        "rule": {"grid": rule.grid, "min_rows": rule.min_rows, "crosses_pieces": rule.crosses_pieces},
        "prompts": [r.as_dict() for r in results],
        "seconds": round(seconds, 1),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    body["checksum"] = _checksum(body)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key_digest(key)}.json"
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def load(key: dict[str, str], folder: Path | None = None) -> CutRule | None:
    """The proven rule for `key`, or None (no verdict, or a file that is not one: a wrong format, checksum or key)."""
    path = (folder or VERDICT_DIR) / f"{key_digest(key)}.json"
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("cut verdict %s is unreadable (%s); restores use the fixed grid of 8", path, exc)
        return None
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("key"), dict) \
            or _compared(body["key"]) != _compared(key):
        log.warning("cut verdict %s is not a %s for this model and build; restores use the fixed grid of 8",
                    path, FORMAT)
        return None
    checksum = body.pop("checksum", None)
    if checksum != _checksum(body):
        log.warning("cut verdict %s fails its checksum; restores use the fixed grid of 8", path)
        return None
    try:
        r = body["rule"]
        return CutRule(int(r["grid"]), int(r["min_rows"]), bool(r["crosses_pieces"]), proven=True,
                       source=source_line(key))
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("cut verdict %s holds no usable rule (%s); restores use the fixed grid of 8", path, exc)
        return None


def rule_for(settings, model_path: Path | None, fingerprint: dict[str, str],
             folder: Path | None = None) -> CutRule:
    """The rule an engine's restores follow: the verdict proven for it, else DEFAULT_RULE. `fingerprint`: the
    engine's namespace keys; its `llama_cpp_python` names the release it runs (a llama-server built by
    ./scripts/build_llama_server.sh from that release's sources and flags says the same release; any other
    server names its own build, which no probe here ran)."""
    if model_path is None:
        return DEFAULT_RULE
    try:
        key = verdict_key(settings, model_path)
    except (OSError, ImportError) as exc:
        log.info("no cut verdict looked up (%s); restores use the fixed grid of 8", exc)
        return DEFAULT_RULE
    if fingerprint.get("llama_cpp_python") != key["llama_cpp_python"]:
        return DEFAULT_RULE
    return load(key, folder) or DEFAULT_RULE
