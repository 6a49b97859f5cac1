"""Why a prompt was recomputed: one cause from a fixed list for the first token that was not restored.

Place in the flow: ... lookup -> fetch + confirm (ChunkKV.find_prefix: a RestorePlan) -> **explain what the plan
did not cover** -> restore -> prefill the rest. The record carries the answer (RequestRecord.miss_reason, a code
from MISS_REASONS; miss_detail, text for a person; hit_tiers, the restored tokens by tier).

A hit costs nothing here: the plan already says how far it reached. A miss costs at most one call on the store
(TieredStore / RemoteStore `probe_miss`: one round trip to a cache server): the eviction ring's entries for the
first missing keys, whether they are being written, which tiers are down, and whether the prompt's keys under
the other namespaces the store holds (learnt from the previous probe, or asked for once in a fresh process) are
present. Causes are tried from the most specific to the least; `none_stored` is what remains.

Only namespaces of the request's own cache salt are probed on its path (issue 46): a salt is a tenant of serve,
and whether another salt holds the prompt must change nothing the tenant receives, neither the cause's text nor
how long naming it took. A miss left `none_stored` while other salts' namespaces exist carries
`MissReport.operator_probe`: the probe across them, which the owner's tools run inline (`across_salts=True`,
`kvbridge explain`) and serve runs after the answer has left, for the operator's /metrics only.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvbridge.engine.cold_cut import DEFAULT_RULE, CutRule
from kvbridge.engine.hashing import ChunkHasher, tail_key
from kvbridge.engine.namespace import NAMESPACE_VERSION
from kvbridge.store.history import MIN_HISTORY, MissProbe

# The fixed list of causes, each with the text a person reads beside the code.
MISS_REASONS: dict[str, str] = {
    "cold": "the request ran in cold mode: nothing is restored by design",
    "none_stored": "nothing is stored under this prefix",
    "evicted": "it was stored and evicted",
    "other_namespace": "it is stored under another namespace (another model, build, KV layout or salt)",
    "diverged": "a stored prompt continues the matched prefix with other tokens",
    "tier_down": "a tier that may hold it is down or timed out",
    "lease_busy": "it is being written and was not readable yet",
    "window_incomplete": "its sliding-window rows (or recurrent state) were not all captured, so it was not stored",
    "refused": "the architecture or the stored object was refused: KV of this model is not restored exactly",
    "below_chunk": "the rest is shorter than a piece this path can restore",
}
MAX_PROBED_NAMESPACES = 16   # other namespaces probed on a miss (most bytes first)
EXCERPT_TOKENS = 6           # tokens of text shown either side of a divergence


@dataclass(frozen=True)
class MissReport:
    """The cause for the first token not restored ("" when every token that could be restored was)."""

    reason: str = ""
    detail: str = ""
    at_token: int = 0                       # the first prompt position not restored
    hit_tiers: dict[str, int] = field(default_factory=dict)   # restored tokens by tier
    probe_ms: float = 0.0                   # what explaining cost
    round_trips: int = 0
    # the probe under other cache salts' namespaces, left off the request's path: returns the true cause
    # (reason, detail), or None when they hold nothing either; None when there is nothing to probe
    operator_probe: Callable[[], tuple[str, str] | None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.reason and self.reason not in MISS_REASONS:
            raise ValueError(f"miss reason must be one of {sorted(MISS_REASONS)}, got {self.reason!r}")

    def apply(self, record) -> None:
        """Write the report into a RequestRecord."""
        record.miss_reason = self.reason
        record.miss_detail = self.detail
        record.hit_tiers = hit_tiers_text(self.hit_tiers)
        record.explain_ms = round(self.probe_ms, 3)
        # not a field of the record (exports and the GUI read those): what serve runs after the answer left
        record.operator_probe = self.operator_probe


def hit_tiers_text(by_tier: dict[str, int]) -> str:
    """{"L1": 256, "L2": 96} -> "L1=256 L2=96" (the record's and the header's form)."""
    return " ".join(f"{tier}={n}" for tier, n in by_tier.items() if n)


def parse_hit_tiers(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in (text or "").split():
        tier, _, n = part.partition("=")
        if tier and n.isdigit():
            out[tier] = out.get(tier, 0) + int(n)
    return out


def nothing_stored(at: int) -> str:
    """The detail of `none_stored` after `from token {at} of {n}: ` (kvbridge.serve.misses shows it too)."""
    if at == 0:
        return "nothing is stored under this prompt's first chunk"
    return f"the store holds the first {at} tokens of this prompt; nothing stored continues it"


# -- namespaces ----------------------------------------------------------------------------------------
def namespace_fields(namespace: str) -> dict[str, str]:
    """A namespace string (kvbridge.engine.namespace.build_namespace) as its fields; {} for a foreign one."""
    parts = namespace.split("|")
    if not parts or parts[0] != NAMESPACE_VERSION:
        return {}
    fields: dict[str, str] = {}
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if sep:
            fields[name] = value
    return fields


def _short(value: str) -> str:
    return value[:12] + "…" if len(value) > 16 else value


def namespace_difference(ours: str, theirs: str) -> list[str]:
    """The fields that differ, for a person: ["cache_type_k f16→f32", "model_sha256 3fa2…→9c01…"]."""
    a, b = namespace_fields(ours), namespace_fields(theirs)
    if not a or not b:
        return ["namespace format"] if ours != theirs else []
    out = []
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            out.append(f"{name} {_short(b.get(name, 'none'))}→{_short(a.get(name, 'none'))}")
    return out


SALT_FIELD = "cache_salt"   # the namespace field a salt's digest lives in (kvbridge.scheduler.salts)


def same_salt(ours: str, theirs: str) -> bool:
    """Both namespaces belong to one cache salt (both unsalted, or the same salt's digest)."""
    return namespace_fields(ours).get(SALT_FIELD) == namespace_fields(theirs).get(SALT_FIELD)


def chunk_size_of(namespace: str) -> int:
    try:
        return int(namespace_fields(namespace).get("chunk", "0"))
    except ValueError:
        return 0


# -- the explainer ------------------------------------------------------------------------------------
class MissExplainer:
    """Names the cause of a miss for one namespace's ChunkKV (CachedEngine and the scheduler hold one each).

    On a request's path it probes only namespaces of the request's own cache salt; other salts' namespaces are
    probed only by `MissReport.operator_probe` (run off the path) or with `across_salts=True` (the owner's tools).
    What else reaches a client of serve is redacted there (kvbridge.serve.misses).
    """

    def __init__(self, store, namespace: str, seed: bytes, chunk_size: int, *,
                 detokenize: Callable[[Sequence[int]], str] | None = None) -> None:
        self.store = store
        self.namespace = namespace
        self.seed = seed
        self.chunk_size = chunk_size
        self.detokenize = detokenize
        self.cut_rule: CutRule = DEFAULT_RULE   # where the engine's restores end (ChunkKV.cut_rule)
        self._not_stored: OrderedDict[bytes, str] = OrderedDict()   # key -> why it was not stored (this process)
        self._known_namespaces: dict[str, int] = {}                 # from the last probe (or the engine's start)
        self._lock = threading.Lock()

    # what this process failed to store ------------------------------------------------------------
    def note_not_stored(self, key: bytes, why: str) -> None:
        """A chunk or tail this process could not store (its window rows or recurrent state were missing)."""
        with self._lock:
            self._not_stored[key] = why
            self._not_stored.move_to_end(key)
            while len(self._not_stored) > MIN_HISTORY:
                self._not_stored.popitem(last=False)

    def forget_not_stored(self, key: bytes) -> None:
        with self._lock:
            self._not_stored.pop(key, None)

    def _why_not_stored(self, key: bytes) -> str | None:
        with self._lock:
            return self._not_stored.get(key)

    def learn_namespaces(self) -> None:
        """Ask the store once which namespaces it holds (an engine does at start, off any request's path), so the
        first miss probes them in its one call instead of learning them from it and asking again."""
        if hasattr(self.store, "probe_miss"):
            self._known_namespaces = dict(self.store.probe_miss([], []).namespaces)

    # reports without a store call ------------------------------------------------------------------
    @staticmethod
    def fixed(reason: str, detail: str, *, at_token: int = 0, hit_tiers: dict[str, int] | None = None) -> MissReport:
        return MissReport(reason=reason, detail=detail or MISS_REASONS[reason], at_token=at_token,
                          hit_tiers=dict(hit_tiers or {}))

    # the whole explanation -------------------------------------------------------------------------
    def explain(self, tokens: Sequence[int], hashes: Sequence[bytes], plan=None, *, fault: str = "",
                probe: bool = True, across_salts: bool = False) -> MissReport:
        """Why `plan` (a RestorePlan, or None when no restore was tried) does not cover tokens[:len-1].

        `fault`: a storage fault the lookup or the restore hit (a counted miss), which is then the cause.
        `probe`: False skips the store call (the cause is then found from the plan alone, or none_stored).
        `across_salts`: other cache salts' namespaces are probed here too (the owner's `kvbridge explain`);
        otherwise a `none_stored` left by the own-salt probe carries `operator_probe` for them.
        """
        started = time.perf_counter()
        n = len(tokens)
        # the most a restore may give: all but the last token, or less where restores end on the cold-cut grid
        said = getattr(plan, "limit", -1) if plan is not None else -1
        limit = said if said >= 0 else n - 1
        matched = plan.matched_tokens if plan is not None else 0
        by_tier = dict(getattr(plan, "tier_tokens", {}) or {}) if plan is not None else {}
        if n > 1 and limit < 1:
            return MissReport(reason="below_chunk", at_token=0, hit_tiers=by_tier,
                              detail=f"the prompt has {n} tokens: a restore leaves the last {self.cut_rule.min_rows} or more of a prompt "
                              "to the engine (so its answer equals a cold run's), and this one is computed whole")
        if limit < 1:
            return MissReport(reason="below_chunk" if n else "", at_token=0, hit_tiers=by_tier,
                              detail="the prompt has one token: the last token of a prompt is always computed")
        if matched >= limit:
            return MissReport(hit_tiers=by_tier, at_token=matched)
        at = matched
        # a restore cut back to the cold-cut grid: the cause is why the stored KV stops where it does (its reach)
        reach = max(at, getattr(plan, "reach", 0) if plan is not None else 0)
        report = self._cause(tokens, hashes, plan, reach, fault, probe, across_salts)
        grid_note = ""
        if reach > at:
            grid_note = (f" (restored to token {at}: restores end on a grid of {self.cut_rule.grid} tokens, so the engine computes "
                         "the rest with the kernels its cold run used)")
        later = None
        if report[0] == "none_stored" and probe and not across_salts:
            later = self._operator_probe(tokens, reach, grid_note)
        return MissReport(reason=report[0], detail=report[1] + grid_note, at_token=at, hit_tiers=by_tier,
                          probe_ms=(time.perf_counter() - started) * 1000, round_trips=report[2],
                          operator_probe=later)

    def _cause(self, tokens, hashes, plan, at: int, fault: str, probe: bool,
               across_salts: bool = False) -> tuple[str, str, int]:
        c = self.chunk_size
        n = len(tokens)
        where = f"from token {at} of {n}"
        if fault:
            return "tier_down", f"{where}: the store failed ({fault}); recomputed", 0
        # a stored object continued the matched prefix with other tokens (the plan read it: no extra call)
        diverged = self._diverged(tokens, plan, at)
        if diverged:
            return "diverged", diverged, 0
        below = getattr(plan, "uncut", None) if plan is not None else None
        if below:
            return "below_chunk", f"{where}: {below}", 0
        boundary = at // c
        keys = []
        if boundary < len(hashes):
            keys.append(hashes[boundary])
        keys.append(tail_key(hashes[boundary - 1] if boundary else self.seed))
        for key in keys:
            why = self._why_not_stored(key)
            if why:
                return "window_incomplete", f"{where}: not stored by this process: {why}", 0
        if not probe or not hasattr(self.store, "probe_miss"):
            return "none_stored", f"{where}: {nothing_stored(at)}", 0
        candidates = self._candidates(self._known_namespaces, across_salts)
        result: MissProbe = self.store.probe_miss(keys, self._probe_keys(tokens, at, candidates))
        trips = result.round_trips
        self._known_namespaces = dict(result.namespaces)
        cause = self._probed_cause(where, boundary < len(hashes), result, candidates)
        unprobed = [namespace for namespace in self._candidates(result.namespaces, across_salts)
                    if namespace not in candidates]
        if cause is None and unprobed:
            # namespaces this explainer had not probed (stored since it last asked): probed once, or the first miss
            # after another namespace appears would read none_stored; a miss with a cause already costs one call
            again = self.store.probe_miss([], self._probe_keys(tokens, at, unprobed))
            trips += again.round_trips
            cause = self._probed_cause(where, False, MissProbe(found=again.found), unprobed)
        if cause is not None:
            return cause[0], cause[1], trips
        return "none_stored", f"{where}: {nothing_stored(at)}", trips

    def _probed_cause(self, where: str, own_chunk_asked: bool, result: MissProbe,
                      owners: list[str]) -> tuple[str, str] | None:
        """The cause a probe's answer names, most specific first; None when it names none (none_stored)."""
        for entry in result.history:
            if entry is not None and entry.gone:
                return "evicted", f"{where}: {entry.describe()}"
        # keys[0] is this prompt's own chunk when the prompt has one at the boundary (content-addressed: its write
        # is ours); the tail key is shared by every prompt with the same run before it, so a tail being written may
        # be another prompt's, and while a tier is down its queued writes are stuck there: the tier is the cause
        own_chunk = own_chunk_asked and bool(result.pending[:1]) and result.pending[0]
        if own_chunk or (result.pending and result.pending[-1] and not result.down):
            return "lease_busy", (f"{where}: the object is being written right now (a write lease or the write queue "
                                  "holds it) and was not readable yet; a request a moment later restores it")
        if result.down:
            tiers = "; ".join(f"{tier}: {why}" for tier, why in result.down.items())
            return "tier_down", f"{where}: a tier that may hold it is unreachable ({tiers})"
        for namespace, tier in zip(owners, result.found):
            if tier:
                differs = namespace_difference(self.namespace, namespace)
                return "other_namespace", (f"{where}: stored in {tier} under another namespace; what differs: "
                                           f"{', '.join(differs) or 'the namespace string'}")
        return None

    def _operator_probe(self, tokens, at: int, grid_note: str) -> Callable[[], tuple[str, str] | None] | None:
        """The probe under other salts' namespaces, as a call for later (None when the store holds none): its
        cost and its answer stay off the request's path, so the tenant cannot time what it finds."""
        others = [namespace for namespace in self._candidates(self._known_namespaces, across_salts=True)
                  if not same_salt(self.namespace, namespace)]
        if not others or not hasattr(self.store, "probe_miss"):
            return None
        tokens = list(tokens)
        where = f"from token {at} of {len(tokens)}"

        def probe() -> tuple[str, str] | None:
            answer = self.store.probe_miss([], self._probe_keys(tokens, at, others))
            cause = self._probed_cause(where, False, MissProbe(found=answer.found), others)
            return None if cause is None else (cause[0], cause[1] + grid_note)

        return probe

    def _diverged(self, tokens, plan, at: int) -> str:
        """The plan saw a stored object after the matched prefix whose tokens differ from the prompt's."""
        seen = getattr(plan, "continuation", None) if plan is not None else None
        if not seen:
            return ""
        start, stored = seen
        if start > at or at == 0:
            return ""   # nothing matched: a prompt that shares no token with a stored one has not diverged from it
        offset = at - start
        if offset >= len(stored) or at >= len(tokens) - 1:
            return ""   # the stored object ends where the match ends: the prompt merely extends it
        if int(stored[offset]) == int(tokens[at]):
            return ""
        text = f"the prompt diverges from a stored prompt at token {at}"
        if self.detokenize is not None:
            ours = self._excerpt(tokens, at)
            theirs = self._excerpt(list(tokens[:at]) + [int(t) for t in stored[offset:offset + EXCERPT_TOKENS]], at)
            text += f": here …{ours[0]}⟨{ours[1]}⟩…, stored …{theirs[0]}⟨{theirs[1]}⟩…"
        return text

    def _excerpt(self, tokens, at: int) -> tuple[str, str]:
        try:
            before = self.detokenize(list(tokens[max(0, at - EXCERPT_TOKENS):at]))
            after = self.detokenize(list(tokens[at:at + EXCERPT_TOKENS]))
        except Exception:   # an excerpt is decoration: a tokenizer that cannot decode leaves it out
            return "", ""
        return before.replace("\n", "⏎")[-40:], after.replace("\n", "⏎")[:40]

    def _candidates(self, namespaces: dict[str, int], across_salts: bool = False) -> list[str]:
        """Other namespaces worth probing, most bytes first: KVBridge namespaces with a chunk size, of this
        namespace's cache salt only unless `across_salts`."""
        out = []
        for namespace, _ in sorted(namespaces.items(), key=lambda kv: -kv[1]):
            if namespace == self.namespace or not namespace_fields(namespace) or chunk_size_of(namespace) < 1:
                continue
            if not across_salts and not same_salt(self.namespace, namespace):
                continue
            out.append(namespace)
        return out[:MAX_PROBED_NAMESPACES]

    def _probe_keys(self, tokens, at: int, namespaces: list[str]) -> list[bytes]:
        """Per namespace, the key of the piece holding token `at` under that namespace's seed and chunk size."""
        probes = []
        for namespace in namespaces:
            size = chunk_size_of(namespace)
            hasher = ChunkHasher(size, namespace)
            index = at // size
            hashes = hasher.chunk_hashes(tokens[:(index + 1) * size])
            probes.append(hashes[index] if index < len(hashes) else tail_key(hashes[index - 1] if index else hasher.seed))
        return probes
