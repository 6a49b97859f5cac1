"""Chunk-level KV objects with token-granular reuse, on top of the tiered store.

Place in the flow: chunk hashes -> **lookup -> fetch + confirm -> assemble** -> restore ...
generate -> save_state -> **split -> put new chunks and the tail**.

A prompt of n tokens and chunk size c has n // c full chunks; chunk i is stored under its rolling
hash H[i] (shared by every prompt with the same first (i+1)*c tokens, so a shared prefix is stored
once). Only full chunks have hashes, so the rest of the prompt is kept as a *tail*: the cells from
a chunk boundary to the end of the prompt, with their token ids, filed under tail_key(H[j-1])
(tail_key(seed) for j = 0). Tails are kept at the last two boundaries, so a prompt that diverges
inside the previous prompt's last full chunk still reuses up to the divergence. After k chunks
match, the tail's longest common token prefix with the new prompt is restored too and the rest
trimmed: reuse is token-granular like llama.cpp's own cache, and deduplicated like LMCache. With `cold_cut`
(CachedEngine) a restore ends where the engine prefills the rest with its cold run's arithmetic (cold_cut).

A recurrent or hybrid model's state cannot be cut by position: each chunk carries the recurrent state
captured where it ends (Backend.boundary_state), a tail only where the engine captured one token before the
prompt's end (the scheduler; CachedEngine's engine prefills them chunk by chunk, so it keeps none), and a restore
ends where a whole stored piece ends.

Where the layout is not understood (kvbridge.formats.llama_state.LayoutError), whole-sequence snapshots are kept
instead (kind "snapshot", snapshots), and the engine's own prefix matching trims them after a restore. What a lookup
found is a RestorePlan (restore_plan); shadow engines keep the same hashes and tails as token ids only
(shadow_index).
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from kvbridge.backends.base import SeqState, WindowCapture
from kvbridge.engine.assembly_buffer import AssemblyBuffer
from kvbridge.engine.cold_cut import DEFAULT_RULE, CutRule
from kvbridge.engine.hashing import tail_key, tokens_digest
from kvbridge.engine.misses import MissExplainer
from kvbridge.engine.restore_plan import RestorePlan, common_prefix_length
from kvbridge.engine.snapshots import plan_snapshot, snapshot_blob
from kvbridge.engine.stages import StageTimer
from kvbridge.formats.llama_chunks import ChunkView, assemble_state, assembled_size, decode_chunk, encode_chunk
from kvbridge.formats.llama_state import (KVGeometry, LayoutError, ParsedState, RecurrentSection, parse_recurrent_capture,
                                         parse_state, parse_window_rows, with_window_rows)
from kvbridge.store import ObjectMeta, ObjectVanished, TieredStore

log = logging.getLogger(__name__)
TAIL_DEPTH = 2          # tails kept at the last TAIL_DEPTH chunk boundaries of each stored prompt


class ForeignState(Exception):
    """A saved engine state whose own token ids are not the prompt's: nothing of it may be stored."""


class ChunkKV:
    """Reads and writes one namespace's chunk and tail objects for a full-KV engine."""

    def __init__(self, store: TieredStore, namespace: str, seed: bytes, chunk_size: int,
                 geometry: KVGeometry | None, buffer: AssemblyBuffer | None = None):
        self.store = store
        self.namespace = namespace
        self.seed = seed
        self.chunk_size = chunk_size
        self.geometry = geometry   # None: layout not understood -> whole snapshots
        # one reusable assembly buffer (a fresh 40 MB buffer per restore costs page faults); a shared one
        # (the scheduler's salts) is closed by whoever made it
        self._buffer = buffer if buffer is not None else AssemblyBuffer()
        self._own_buffer = buffer is None
        self.hot_hits = 0   # restores served from the state already assembled in the scratch buffer
        self.hot_restores = True   # False: every restore reads and assembles its objects (the transport benches)
        self.prefault_scratch = True   # the engine turns it off when the backend supplies its own buffer
        self.n_stream = 1   # the streams of the cache restores go into (a non-unified cache: one per sequence id)
        self.incomplete = 0   # objects not stored because sliding-window rows were missing (the engine counts them)
        # True: a restore ends where the engine prefills the rest as its cold run did (kvbridge.engine.cold_cut);
        # CachedEngine's promise (greedy output equals cold). False: all but the last token (the scheduler's rule)
        self.cold_cut = False
        # names the cause of a miss (kvbridge.engine.misses); it remembers what this process could not store
        self.misses = MissExplainer(store, namespace, seed, chunk_size)
        self._cut_rule: CutRule = DEFAULT_RULE

    @property
    def cut_rule(self) -> CutRule:
        """Where restores end when `cold_cut` is on: the cut probe's verdict for this model, build and CPU
        (kvbridge.engine.cut_verdicts), or the fixed grid of 8; the miss explainer words its notes by it."""
        return self._cut_rule

    @cut_rule.setter
    def cut_rule(self, rule: CutRule) -> None:
        self._cut_rule = self.misses.cut_rule = rule

    def close(self) -> None:
        if self._own_buffer:
            self._buffer.close()

    # restore -----------------------------------------------------------------------------
    def plan_restore(self, tokens: Sequence[int], hashes: Sequence[bytes],
                     buffer_for: Callable[[int, Sequence[int]], np.ndarray | None] | None = None,
                     tail_override: tuple[bytes, bytes] | None = None) -> RestorePlan:
        """find_prefix() and assemble() in one step."""
        plan = self.find_prefix(tokens, hashes, tail_override)
        try:
            if plan.matched_tokens:
                self.assemble(plan, buffer_for)
        finally:
            plan.release()
        return plan

    def find_prefix(self, tokens: Sequence[int], hashes: Sequence[bytes],
                    tail_override: tuple[bytes, bytes] | None = None, timer: StageTimer | None = None) -> RestorePlan:
        """Fetch and confirm the longest stored prefix of `tokens`: at most len-1 (the last token is recomputed),
        or with `cold_cut` at most what kvbridge.engine.cold_cut allows, on its grid.

        Objects a remote store lends (shared-memory views) are kept in plan.borrowed: the caller
        calls plan.release() once the plan is assembled or abandoned. `tail_override` (boundary, key):
        the tail after that boundary (a chunk hash or the seed) is read from `key` instead of
        tail_key(boundary) (a swapped-out sequence's own tail, which no other prompt overwrites).
        `timer` gets the lookup and the fetch (with the confirmation) as two stages.
        """
        timer = timer or StageTimer()
        limit = len(tokens) - 1
        if self.geometry is None:
            if limit < 1:
                return RestorePlan()
            with timer.stage("fetch"):
                return self._plan_snapshot(tokens, hashes, limit)
        if self._cuts():
            limit = self.cut_rule.restorable(len(tokens))
        elif self.cold_cut and self.geometry.recurrent:
            # CachedEngine's engine prefills these models chunk by chunk: the last chunk's end before the prompt's
            # end is where a cold run's step ends too (kvbridge.backends.llamacpp)
            limit = (len(tokens) - 1) // self.chunk_size * self.chunk_size
        plan = RestorePlan(limit=max(limit, 0))
        if limit < 1:
            return plan
        try:
            self._find_chunks(plan, tokens, hashes, limit, tail_override, timer)
        except BaseException:
            plan.release()
            raise
        return plan

    def _find_chunks(self, plan: RestorePlan, tokens: Sequence[int], hashes: Sequence[bytes], limit: int,
                     tail_override: tuple[bytes, bytes] | None, timer: StageTimer) -> None:
        """Lookup, then the hit chunks and the tail after them in one get_many (one round trip to a
        cache server); a chunk that fails its check ends the prefix, and the tail at that boundary
        is fetched on its own."""
        c = self.chunk_size
        with timer.stage("lookup"):
            found = self.store.lookup(list(hashes), namespace=self.namespace)
        plan.store_calls += 1
        wanted = min(found.n_hit, limit // c)
        boundary_key = dict([tail_override]) if tail_override else {}
        at = hashes[wanted - 1] if wanted else self.seed
        tail_at = boundary_key.get(at) or tail_key(at)
        with timer.stage("fetch"):
            if not self._hot_plan(plan, tokens, limit, wanted, tail_at, found.tiers):
                self._fetch_chunks(plan, tokens, hashes, limit, boundary_key, wanted, tail_at)

    def _hot_plan(self, plan: RestorePlan, tokens: Sequence[int], limit: int, wanted: int, tail_at: bytes,
                  tiers: Sequence[str]) -> bool:
        """True when the state already assembled in the scratch buffer is the restore: its tokens begin the
        prompt, cover the stored chunk run and reach at least as far as the stored tail after it. Only that
        tail is read then (to learn how far the store reaches), no chunk, and nothing is assembled."""
        hot, c = self._buffer.tokens_held(self.namespace), self.chunk_size
        if (not self.hot_restores or hot is None or not wanted * c <= len(hot) <= limit
                or common_prefix_length(hot, tokens) < len(hot)):
            return False
        obj = plan.borrow(self.store.get(tail_at, namespace=self.namespace))
        plan.store_calls += 1
        plan.count_fetched(obj)
        _, keep = self._tail_keep(obj, tokens, wanted * c, limit, plan)
        reach = wanted * c + keep
        if self._cuts():
            reach = self.cut_rule.cut(reach, len(tokens))
        if reach > len(hot) or reach == 0:
            return False   # the store holds more of this prompt (or none of it: a miss stays a miss)
        plan.hot = True
        plan.tokens = [int(t) for t in hot]
        plan.matched_tokens = len(hot)
        plan.chunks_hit = wanted
        for tier in list(tiers[:wanted]) + ([obj.tier] if obj is not None else []):
            plan.tier = self.store.slower(plan.tier, tier)
        for tier in tiers[:wanted]:
            plan.add_tokens(tier, c)
        if obj is not None:
            plan.add_tokens(obj.tier, len(hot) - wanted * c)
        plan.lossy = set(self._buffer.lossy)
        if plan.lossy:
            plan.notes.append(f"restored from lossy {'+'.join(sorted(plan.lossy))} KV: output may differ from cold")
        return True

    def _fetch_chunks(self, plan: RestorePlan, tokens: Sequence[int], hashes: Sequence[bytes], limit: int,
                      boundary_key: dict[bytes, bytes], wanted: int, tail_at: bytes) -> None:
        c = self.chunk_size
        fetched = [plan.borrow(obj)
                   for obj in self.store.get_many(list(hashes[:wanted]) + [tail_at], namespace=self.namespace)]
        plan.store_calls += 1
        for obj in fetched:
            plan.count_fetched(obj)
        found: list[tuple[ChunkView, object, int]] = []   # (view, object, cells that continue the prompt)
        for i, obj in enumerate(fetched[:wanted]):
            view = self._confirmed(obj, tokens[i * c:(i + 1) * c], plan)
            if view is None:
                break
            found.append((view, obj, c))
        start = len(found) * c
        if len(found) == wanted:
            obj = fetched[-1]
        else:
            prev = hashes[len(found) - 1] if found else self.seed
            obj = plan.borrow(self.store.get(boundary_key.get(prev) or tail_key(prev), namespace=self.namespace))
            plan.store_calls += 1
            plan.count_fetched(obj)
        view, keep = self._tail_keep(obj, tokens, start, limit, plan)
        if keep > 0:
            found.append((view, obj, keep))
        left = n = self._cut_to_rule(start + keep, len(tokens), plan)
        for view, obj, cells in found:
            take = min(cells, left)
            if take < 1:
                break
            plan.pieces.append((view, take))
            plan.blobs.append(obj.blob)
            plan.tier = self.store.slower(plan.tier, obj.tier)
            plan.add_tokens(obj.tier, take)
            plan.lossy |= {obj.meta.lossy} - {""}
            left -= take
        plan.chunks_hit = min(start, n) // c
        plan.tokens = list(tokens[:n])
        plan.matched_tokens = n
        if plan.lossy:
            plan.notes.append(f"restored from lossy {'+'.join(sorted(plan.lossy))} KV: output may differ from cold")

    def _cuts(self) -> bool:
        """Whether restores end on the cold-cut grid: asked for, and the KV can be cut by position."""
        return self.cold_cut and self.geometry is not None and not self.geometry.recurrent

    def _cut_to_rule(self, n: int, n_prompt: int, plan: RestorePlan) -> int:
        """`n` restorable tokens, cut where the rule lets a restore end when restores are cut (plan.reach keeps `n`)."""
        cut = self.cut_rule.cut(n, n_prompt) if self._cuts() else n
        if cut != n:
            plan.reach = n
        return cut

    def assemble(self, plan: RestorePlan,
                 buffer_for: Callable[[int, Sequence[int]], np.ndarray | None] | None = None) -> SeqState:
        """The plan's pieces as one engine state, in the engine's buffer (buffer_for) or a reusable one."""
        if plan.state is not None:
            return plan.state
        n = plan.matched_tokens
        size = assembled_size(self.geometry, n, n_stream=self.n_stream)
        out = buffer_for(size, plan.tokens) if buffer_for is not None else None
        if plan.hot:
            # the scratch buffer holds this very state from the last assembly: the same tokens under the same
            # namespace are the same KV, so a warm restore of a hot prefix is the engine's one copy, not two
            # (one more when the engine wants it in a buffer of its own)
            plan.release()
            self.hot_hits += 1
            if out is None:
                plan.state = SeqState(data=memoryview(self._buffer.data)[:size], n_tokens=n)
            else:
                np.copyto(out[:size], self._buffer.data[:size])
                plan.state = SeqState(data=out[:size], n_tokens=n)
            return plan.state
        scratch = out is None
        if scratch:
            out = self._buffer.room(size)   # written over from here on
        else:
            self._buffer.forget()           # the hot state is only the one assembled last
        # the state lives in `out`: valid until the next assemble (one request at a time)
        data = assemble_state(self.geometry, plan.pieces, out=out, run=self._buffer.run_jobs, n_stream=self.n_stream)
        torn = [obj for obj in plan.borrowed if obj.intact is not None and not obj.intact()]
        plan.release()
        if torn:
            raise ObjectVanished(f"{len(torn)} object(s) changed in shared memory while they were copied "
                                 "(a lease expired); nothing of this restore is used")
        if scratch:
            self._buffer.holds(self.namespace, plan.tokens, plan.lossy)
        plan.state = SeqState(data=data, n_tokens=n)
        return plan.state

    def _tail_keep(self, obj, tokens: Sequence[int], start: int, limit: int,
                   plan: RestorePlan) -> tuple[ChunkView | None, int]:
        """A fetched tail object (or None) and how many of its cells continue the prompt from `start`."""
        if obj is None or obj.meta.kind != "tail":
            return None, 0
        view = self._decoded(obj.blob, plan)
        if view is None:
            return None, 0
        keep = max(0, min(common_prefix_length(view.token_ids, tokens[start:]), limit - start))
        plan.continuation = (start, view.token_ids.copy())   # what the misses explainer compares against
        if self.geometry.recurrent and keep < view.n_cells:
            if keep:
                plan.uncut = (f"a stored piece of {view.n_cells} tokens matches {keep} of them, and a recurrent "
                              "state cannot be cut: the whole piece or none of it")
            return None, 0   # a recurrent section cannot be cut: the whole tail or none of it
        return view, keep

    def _decoded(self, blob: bytes, plan: RestorePlan) -> ChunkView | None:
        try:
            return decode_chunk(blob, self.geometry)
        except LayoutError as exc:
            plan.notes.append(f"stored object rejected ({exc}); recomputed")
            return None

    def _confirmed(self, obj, expected: Sequence[int], plan: RestorePlan) -> ChunkView | None:
        """A hash hit is trusted only when the object's token ids equal the prompt's."""
        if obj is None or obj.meta.kind != "chunk":
            return None
        view = self._decoded(obj.blob, plan)
        if view is None:
            return None
        if view.n_cells != len(expected) or not np.array_equal(view.token_ids, np.asarray(expected)):
            plan.notes.append("hash hit with different token ids rejected")
            plan.continuation = (len(plan.pieces) * self.chunk_size, view.token_ids.copy())
            return None
        return view

    def _plan_snapshot(self, tokens: Sequence[int], hashes: Sequence[bytes], limit: int) -> RestorePlan:
        keys = [tail_key(hashes[-1])] if hashes else []
        return plan_snapshot(self.store, self.namespace, keys + [tail_key(self.seed)], tokens, limit, self.chunk_size)

    # store -------------------------------------------------------------------------------
    def _parse(self, data) -> ParsedState:
        g = self.geometry
        return parse_state(data, window=g.window, cell_ext=g.cell_ext, recurrent=bool(g.recurrent),
                           attention=g.n_layer > 0)

    def store_prompt(self, state: SeqState, tokens: Sequence[int], hashes: Sequence[bytes],
                     capture: Callable[[int], WindowCapture | None] | None = None,
                     boundary: Callable[[int], "bytes | memoryview | None"] | None = None) -> int:
        """Split the prompt's cells of `state` into chunk and tail objects; put the ones not yet stored.

        Raises ForeignState, storing nothing, unless the engine's own token ids for the state begin
        with the prompt's: another client may have used a shared llama-server slot in between.
        A sliding-window model's state holds the window's rows of its last positions only: `capture`
        (Backend.capture_window) fetches those of earlier positions, and an object whose rows were
        not all captured is not stored (counted in self.incomplete). A recurrent model's chunks and tail
        need the recurrent state captured where each ends (`boundary`: Backend.boundary_state).
        """
        n = len(tokens)
        if state.token_ids is None or tuple(state.token_ids[:n]) != tuple(int(t) for t in tokens):
            raise ForeignState(
                "the engine's saved state does not hold this prompt's tokens" if state.token_ids is not None
                else "the engine did not say which tokens its saved state holds")
        if self.geometry is None:
            return self._store_snapshot(state, tokens, hashes)
        try:
            parsed = self._parse(state.data)
        except LayoutError as exc:
            log.warning("saved KV state not understood (%s); not stored", exc)
            return 0
        if parsed.geometry != self.geometry or parsed.n_cells < n:
            log.warning("saved KV state does not match the engine's geometry or prompt; not stored")
            return 0
        if self.geometry.recurrent:
            return self._store_recurrent(parsed, tokens, hashes, boundary)
        c = self.chunk_size
        n_full = n // c
        # Stored chunks form a leading run (each hash names its whole prefix): one lookup says which
        # are new, and the new objects go to the store in one put_many (one round trip to a server).
        known = self.store.lookup(list(hashes[:n_full]), namespace=self.namespace, purpose="store").n_hit
        tails = [j for j in range(n_full, max(n_full - TAIL_DEPTH, -1), -1) if j * c < n]
        need_from = min([known * c] * (known < n_full) + [j * c for j in tails] or [n])
        parsed = self._with_window(parsed, need_from, capture)
        items = []
        for i in range(known, n_full):
            ids = tokens[i * c:(i + 1) * c]
            if i * c < parsed.window_start:
                self._not_stored(hashes[i], f"the sliding-window rows of positions {i * c}..{parsed.window_start - 1} "
                                            "were not captured")
                break   # a later chunk is unreachable without this one
            items.append(self._item(hashes[i], encode_chunk(parsed, i * c, (i + 1) * c, ids), ids, "chunk"))
        for j in tails:
            prev = hashes[j - 1] if j else self.seed
            if j * c < parsed.window_start:
                self._not_stored(tail_key(prev), f"the sliding-window rows of positions {j * c}.."
                                                 f"{parsed.window_start - 1} were not captured")
                continue
            ids = tokens[j * c:n]
            items.append(self._item(tail_key(prev), encode_chunk(parsed, j * c, n, ids), ids, "tail"))
        stored = self._put_items(items)
        if self.prefault_scratch:
            self._buffer.reserve(assembled_size(self.geometry, n))
        return stored

    def _store_recurrent(self, parsed: ParsedState, tokens: Sequence[int], hashes: Sequence[bytes],
                         boundary: Callable[[int], "bytes | memoryview | None"] | None) -> int:
        """Chunks whose end the engine captured, and one tail up to the prompt's last token but one where the engine
        captured there (the scheduler does; CachedEngine's engine does not: it prefills these models chunk by chunk
        in every mode and a restore ends at a chunk's end, so no token is computed alone: Docs/Research.md §30)."""
        c, n = self.chunk_size, len(tokens)
        n_full = n // c
        known = self.store.lookup(list(hashes[:n_full]), namespace=self.namespace, purpose="store").n_hit

        def section(end: int) -> RecurrentSection | None:
            taken = boundary(end) if boundary is not None else None
            if taken is None:
                return None
            found = parse_recurrent_capture(taken, self.geometry)
            return found if found.pos == end - 1 else None

        items = []
        for i in range(known, n_full):
            rec = section((i + 1) * c)
            if rec is None:
                self._not_stored(hashes[i], f"the recurrent state after position {(i + 1) * c - 1} was not captured")
                break   # a later chunk is unreachable without this one
            ids = tokens[i * c:(i + 1) * c]
            items.append(self._item(hashes[i], encode_chunk(parsed, i * c, (i + 1) * c, ids, rec), ids, "chunk"))
        j, end = (n - 1) // c, n - 1
        rec = section(end) if end > j * c else None
        if rec is not None:
            ids = tokens[j * c:end]
            items.append(self._item(tail_key(hashes[j - 1] if j else self.seed),
                                    encode_chunk(parsed, j * c, end, ids, rec), ids, "tail"))
        stored = self._put_items(items)
        if self.prefault_scratch:
            self._buffer.reserve(assembled_size(self.geometry, n))
        return stored

    def _put_items(self, items: list) -> int:
        """put_many; a key stored now no longer has a 'not stored' cause."""
        stored = 0
        for (key, _, _), done in zip(items, self.store.put_many(items)):
            if done:
                stored += 1
                self.misses.forget_not_stored(key)
        return stored

    def _not_stored(self, key: bytes, why: str) -> None:
        self.incomplete += 1
        self.misses.note_not_stored(key, why)

    def _with_window(self, parsed: ParsedState, need_from: int,
                     capture: Callable[[int], WindowCapture | None] | None) -> ParsedState:
        """Extend a sliding-window state's window rows back to position need_from with captures taken at
        decreasing positions; stops where the engine has no more (after a restore it holds only the
        restored window), and never guesses a row."""
        if not self.geometry.window or capture is None:
            return parsed
        rows, start = [], parsed.window_start
        while start > need_from:
            # one position past the rows still missing: an engine that re-evaluates the last position of a
            # truncated context (llama-server) still hands over exact rows up to `start`
            taken = capture(start + 1)
            if taken is None:
                break
            part = parse_window_rows(taken.data, self.geometry, whole_state=taken.whole_state)
            part = part.first(taken.trusted_end - part.first_pos)
            if not part.first_pos < start <= part.first_pos + part.n_cells:
                break
            rows.append(part)
            start = part.first_pos
        return with_window_rows(parsed, rows)

    def store_tail(self, data, tokens: Sequence[int], start: int, key: bytes,
                   capture: Callable[[int], WindowCapture | None] | None = None) -> bool:
        """Put the cells tokens[start:] of a sequence's saved state as one tail object under `key`."""
        if self.geometry.recurrent:
            return False   # no section was captured at the sequence's end (the scheduler refuses these models)
        try:
            parsed = self._parse(data)
        except LayoutError as exc:
            log.warning("saved KV state not understood (%s); tail not stored", exc)
            return False
        if parsed.geometry != self.geometry or parsed.n_cells < len(tokens):
            return False
        parsed = self._with_window(parsed, start, capture)
        if start < parsed.window_start:
            self._not_stored(key, f"the sliding-window rows of positions {start}..{parsed.window_start - 1} "
                                  "were not captured")
            return False
        ids = tokens[start:]
        result = self.store.put(*self._item(key, encode_chunk(parsed, start, len(tokens), ids), ids, "tail"))
        return result is not False

    def _store_snapshot(self, state: SeqState, tokens: Sequence[int], hashes: Sequence[bytes]) -> int:
        # the engine's own ids for every cell of the snapshot (prompt and generated tokens), already
        # checked to begin with the prompt's: a restore then knows exactly which positions it loads
        ids = np.asarray(state.token_ids[: state.n_tokens], dtype="<i4")
        blob = snapshot_blob(ids, state.data)
        keys = {tail_key(self.seed)} | ({tail_key(hashes[-1])} if hashes else set())
        return sum(self._put(key, blob, list(ids), "snapshot") for key in keys)

    def _item(self, key: bytes, blob: bytes, ids: Sequence[int], kind: str) -> tuple[bytes, bytes, ObjectMeta]:
        return key, blob, ObjectMeta(namespace=self.namespace, n_tokens=len(ids), tokens_digest=tokens_digest(ids),
                                     kind=kind)

    def _put(self, key: bytes, blob: bytes, ids: Sequence[int], kind: str) -> int:
        result = self.store.put(*self._item(key, blob, ids, kind))
        return 0 if result is False else 1
