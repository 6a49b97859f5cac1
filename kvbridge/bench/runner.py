"""Runs a scenario in one or more modes on a CachedEngine, request by request (GUI and bench share it)."""
from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence

from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.errors import BadSettings
from kvbridge.engine.records import MODES, RequestRecord
from kvbridge.bench.scenarios import ScenarioOptions, build_requests, get_scenario

ProgressFn = Callable[[int, int, str], None]   # (done, total, what)


def parse_modes(modes: str | Sequence[str]) -> list[str]:
    items = [m.strip().lower() for m in (modes.split(",") if isinstance(modes, str) else modes) if m.strip()]
    bad = [m for m in items if m not in MODES]
    if bad or not items:
        raise BadSettings(f"Unknown mode(s) {', '.join(bad) or '(none given)'}; use any of {', '.join(MODES)}.")
    return items


def run_scenario(engine: CachedEngine, key: str, modes: str | Sequence[str], n_requests: int | None = None,
                 document: str | None = None, progress: ProgressFn | None = None,
                 stop_event: threading.Event | None = None, n_predict: int | None = None,
                 lengths: Sequence[int] | None = None) -> Iterator[RequestRecord]:
    """Yield one RequestRecord per request, mode after mode; stops early when stop_event is set.

    Each mode starts from an empty native cache so that no mode is helped by the one before it.
    A scenario with its own runner (a measurement, e.g. long-context) orders its requests itself.
    """
    mode_list = parse_modes(modes)
    scenario = get_scenario(key)
    if scenario.run is not None:
        if n_requests is not None and n_requests < 1:
            raise BadSettings(f"The number of requests must be at least 1, got {n_requests}.")
        options = ScenarioOptions(n_requests=n_requests, document=document,
                                  lengths=tuple(lengths) if lengths else None)
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
                yield engine.infer(list(request.messages), mode=mode, n_predict=n_predict, scenario=key,
                                   label=request.label, request_index=index)
            done += 1
    if progress is not None:
        progress(total, total, "done")
