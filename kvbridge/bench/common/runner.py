"""Runs a scenario in one or more modes on a CachedEngine, request by request (GUI and bench share it)."""
from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence

from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.errors import BadSettings, KVBridgeError
from kvbridge.engine.modes import mode_names
from kvbridge.engine.records import RequestRecord
from kvbridge.bench.common.scenarios import ScenarioOptions, build_requests, get_scenario

ProgressFn = Callable[[int, int, str], None]   # (done, total, what)
BeforeRequestFn = Callable[[str], None]        # (mode), called before each request of a list scenario


def parse_modes(modes: str | Sequence[str]) -> list[str]:
    items = [m.strip().lower() for m in (modes.split(",") if isinstance(modes, str) else modes) if m.strip()]
    bad = [m for m in items if m not in mode_names()]
    if bad or not items:
        raise BadSettings(f"Unknown mode(s) {', '.join(bad) or '(none given)'}; use any of {', '.join(mode_names())}.")
    return items


def run_scenario(engine: CachedEngine, key: str, modes: str | Sequence[str], n_requests: int | None = None,
                 document: str | None = None, progress: ProgressFn | None = None,
                 stop_event: threading.Event | None = None, n_predict: int | None = None,
                 lengths: Sequence[int] | None = None,
                 before_request: BeforeRequestFn | None = None,
                 corpus: str | None = None) -> Iterator[RequestRecord]:
    """Yield one RequestRecord per request, mode after mode; stops early when stop_event is set.

    Each mode starts from an empty native cache so that no mode is helped by the one before it.
    A scenario with its own runner (a measurement, e.g. long-context) orders its requests itself.
    before_request(mode) runs before each request, off its clock (e.g. empty_faster_tiers).
    corpus: the rag scenario's corpus (a name in kvbridge.bench.rag.CORPORA, or a path); None: its default.
    """
    mode_list = parse_modes(modes)
    scenario = get_scenario(key)
    if scenario.run is not None:
        if before_request is not None:
            raise BadSettings(f"The {key!r} scenario orders its own requests; emptying tiers before each "
                              "request works with the request-list scenarios (doc-qa, system-prompt, ...).")
        if n_requests is not None and n_requests < 1:
            raise BadSettings(f"The number of requests must be at least 1, got {n_requests}.")
        options = ScenarioOptions(n_requests=n_requests, document=document,
                                  lengths=tuple(lengths) if lengths else None, corpus=corpus)
        yield from scenario.run(engine, mode_list, options, progress=progress, stop_event=stop_event,
                                n_predict=n_predict)
        return
    requests = build_requests(key, n_requests, document)
    total = len(mode_list) * len(requests)
    done = 0
    engine.start()
    for mode in mode_list:
        engine.reset_native_cache()
        index = 0
        for request in requests:
            if stop_event is not None and stop_event.is_set():
                return
            if progress is not None:
                progress(done, total, f"{mode}: {request.label}")
            if request.action == "restart":
                engine.restart_backend(drop_l1=True)
            else:
                index += 1
                if before_request is not None:
                    before_request(mode)
                yield engine.infer(list(request.messages), mode=mode, n_predict=n_predict, scenario=key,
                                   label=request.label, request_index=index)
            done += 1
    if progress is not None:
        progress(total, total, "done")


def run_interleaved(engines: dict[str, CachedEngine], key: str, n_requests: int | None = None,
                    document: str | None = None, progress: ProgressFn | None = None,
                    n_predict: int | None = None,
                    before_request: dict[str, BeforeRequestFn] | None = None) -> Iterator[RequestRecord]:
    """Yield one RequestRecord per (request, mode): each mode on its own engine, the modes taking turns
    request by request, so a change in the machine's speed over the run falls on every mode alike.

    run_scenario runs a whole mode before the next; on two cores the same 15 warm prompt rows took
    ~94 ms through one mode's minute and ~124 ms through the next one's (Docs/Research.md §37), which is
    larger than the differences a side-by-side ratio is meant to show. Each engine starts from an empty
    native cache, as run_scenario's modes do. before_request[mode](mode) runs off the clock.
    """
    modes = list(engines)
    if get_scenario(key).run is not None:
        raise BadSettings(f"The {key!r} scenario orders its own requests; modes can take turns only in the "
                          "request-list scenarios (doc-qa, system-prompt, ...).")
    requests = build_requests(key, n_requests, document)
    for engine in engines.values():
        engine.start()
        engine.reset_native_cache()
    total, done, index = len(modes) * len(requests), 0, 0
    for request in requests:
        if request.action == "restart":
            for engine in engines.values():
                engine.restart_backend(drop_l1=True)
            done += len(modes)
            continue
        index += 1
        for mode in modes:
            if progress is not None:
                progress(done, total, f"{mode}: {request.label}")
            hook = (before_request or {}).get(mode)
            if hook is not None:
                hook(mode)
            yield engines[mode].infer(list(request.messages), mode=mode, n_predict=n_predict, scenario=key,
                                      label=request.label, request_index=index)
            done += 1
    if progress is not None:
        progress(total, total, "done")


def empty_faster_tiers(store, tier: str) -> BeforeRequestFn:
    """A before_request hook that makes every lmcache hit come from `tier` ("L2", "L3").

    Before each lmcache request it waits for the writes the last request queued behind it (the L3
    copies, an L2 copy promoted from L3), so the next request finds them, then empties every tier
    faster than `tier`. Cold and native requests do not read the store and are left alone.
    """
    names = list(store.tier_names)
    if tier not in names:
        hint = " (set KVB_L3_URL, or let the bench start a private Redis)" if tier == "L3" else ""
        raise BadSettings(f"This store has no tier {tier!r}{hint}; its tiers: {', '.join(names)}.")
    faster = names[:names.index(tier)]

    def before(mode: str) -> None:
        if mode != "lmcache":
            return
        if not store.drain():
            raise KVBridgeError("The writes queued behind the last request did not finish within 30 s, so the "
                                f"next request could not be served from {tier}; the run was stopped.")
        for name in faster:
            store.clear(name)

    return before
