"""`kvbridge explain "PROMPT"` (or `--file F`): what a restore of the prompt would take from which tier, why the rest
would not be restored, and the eviction history of the prompt's keys, without evaluating the prompt.

The engine starts as for a request (the model loads and its KV layout probe runs, since the namespace needs the
layout: kvbridge.engine.dry_run says why); then only lookup, fetch and confirm run. The store is KVB_STORE_URL's
cache server when set, else the embedded tiers (KVB_L2_DIR, L3).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from kvbridge.cli.command import Command
from kvbridge.cli.common import add_model_options, make_engine, settings_for_model

DEFAULT_EVICTIONS = 10


def read_prompt(args) -> str:
    """The prompt from the command line or --file, or SystemExit saying what is missing."""
    if args.prompt is not None and args.file:
        raise SystemExit("Give the prompt either as an argument or with --file, not both.")
    if args.file:
        path = Path(args.file).expanduser()
        if not path.is_file():
            raise SystemExit(f"--file {args.file}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"--file {args.file}: cannot be read as UTF-8 text ({exc})") from None
        where = f"the file {args.file}"
    elif args.prompt is not None:
        text, where = args.prompt, "the prompt"
    else:
        raise SystemExit('Give a prompt to explain: kvbridge explain "PROMPT" or kvbridge explain --file FILE.')
    if not text.strip():
        raise SystemExit(f"{where[0].upper()}{where[1:]} is empty: there is nothing to explain.")
    return text


def run(args) -> int:
    from kvbridge.engine.dry_run import dry_run, layout_text
    from kvbridge.scheduler.exact import serve_namespace
    from kvbridge.scheduler.salts import salt_namespace

    if args.evictions < 0:
        raise SystemExit(f"--evictions must be 0 or more, not {args.evictions}.")
    text = read_prompt(args)
    prompt = [{"role": "user", "content": text}] if args.chat else text
    settings = settings_for_model("explain", args)
    engine = make_engine(settings)
    try:
        started = time.perf_counter()
        engine.start()   # loads the model and runs the layout probe, not the prompt
        start_s = time.perf_counter() - started
        # --exact / --no-exact: the prompt as serve's scheduler in that mode stores it (the mode off has its own
        # namespace); without either, as this engine (CachedEngine) stores it
        base, why = serve_namespace(engine) if getattr(args, "exact", None) is not None else (engine.namespace, "")
        namespace = salt_namespace(base, args.salt) if args.salt else (base if why else None)
        result = dry_run(engine, prompt, namespace=namespace, evictions=args.evictions)
        if why:
            result.layout = f"{why}\n"
        result.layout = (result.layout if why else "") + layout_text(engine, start_s)
        where = engine.backend.describe()
        store = f"cache server {settings.store_url}" if settings.store_url else \
            f"embedded ({', '.join(engine.store.tier_names)})"
    finally:
        engine.close()
    if args.json:
        print(json.dumps({**result.to_dict(), "engine": settings.engine, "store": store}, indent=2))
    else:
        print(report_text(result, where, store, settings.chunk_size, salted=bool(args.salt)))
    return 0


def report_text(r, engine: str, store: str, chunk_size: int, salted: bool = False) -> str:
    """The dry run for a person: what, from where, why not the rest, the keys' history."""
    from kvbridge.engine.misses import MISS_REASONS
    from kvbridge.engine.namespace import short_namespace

    now = time.time()
    lines = [f"engine:      {engine}",
             f"store:       {store}",
             f"namespace:   {short_namespace(r.namespace)}{' (salted)' if salted else ''}  ({r.namespace})",
             f"KV layout:   {r.layout}",
             f"prompt:      {r.prompt_tokens} tokens, {r.chunks_total} whole chunks of {chunk_size}"]
    tiers = ", ".join(f"{n} from {tier}" for tier, n in r.hit_tiers.items() if n) or "nothing"
    verb = "predicted reusable" if r.kv_mode == "shadow" else "restorable"
    lines.append(f"{verb}:  {r.restorable_tokens} of {r.prompt_tokens} tokens ({tiers}; {r.chunks_hit} whole chunks)")
    if r.reason:
        lines.append(f"not restored: from token {r.at_token} on: {r.reason} ({MISS_REASONS[r.reason]})")
        lines.append(f"why:         {r.detail}")
    else:
        left = r.prompt_tokens - r.restorable_tokens
        lines.append(f"not restored: only the last {left} token{'s' if left != 1 else ''}, which the engine computes "
                     "as its cold run did")
    lines.append(f"cost:        {r.store_calls} store call(s), {r.explain_ms:.1f} ms for lookup, fetch, confirm and the "
                 "cause; nothing was stored")
    for note in r.notes:
        lines.append(f"note:        {note}")
    if r.history_available:
        if r.key_history:
            lines.append(f"history of this prompt's keys ({len(r.key_history)} eviction(s), newest first):")
            lines += [f"  {e.key.hex()[:12]} {e.describe(now)}" for e in r.key_history]
        else:
            lines.append("history of this prompt's keys: none of them is in the store's eviction ring")
        if r.recent_evictions:
            lines.append(f"the store's newest {len(r.recent_evictions)} eviction(s):")
            lines += [f"  {e.key.hex()[:12]} {e.describe(now)}" for e in r.recent_evictions]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt, as the engine would get it (or --file)")
    parser.add_argument("--file", help="read the prompt from this UTF-8 text file")
    parser.add_argument("--chat", action="store_true",
                        help="the prompt is one user message, rendered through the model's chat template "
                             "(as the GUI's free prompt and serve's chat requests send it)")
    parser.add_argument("--json", action="store_true", help="print JSON (schema kvbridge-explain-1) instead of text")
    parser.add_argument("--evictions", type=int, default=DEFAULT_EVICTIONS,
                        help=f"list the store's N newest evictions too (default {DEFAULT_EVICTIONS}; 0: none)")
    parser.add_argument("--salt", help="look under this cache salt's namespace (serve's cache_salt / a tenant's)")
    add_model_options(parser, "explain")


COMMAND = Command("explain", "show what a prompt would restore from which tier and why the rest would not, "
                             "without evaluating it", run, add_arguments)
