"""The one Backend base class every engine adapter subclasses.

Place in the flow: prompt -> **tokens (Backend.tokenize)** -> chunk hashes -> lookup -> **restore
(Backend.restore_state)** -> **suffix prefill + generate (Backend.generate)** -> **store
(Backend.save_state)**. What an engine can do is the class attribute `kv_mode`, checked in one place
(kvbridge.engine.CachedEngine); nothing else branches on the engine's type or name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Iterator, Literal, Sequence

from kvbridge.settings import Settings
from kvbridge.backends.chat_template import chatml

# tokens per llama_decode call: every llama.cpp engine here (the in-process adapter, llama-server, the scheduler's
# context) prefills a prompt in pieces of this size from position 0, and a restore's cut counts on it
# (kvbridge.engine.cold_cut)
BATCH_TOKENS = 512

if TYPE_CHECKING:
    from kvbridge.formats.architectures import ModelTraits

KVMode = Literal["full", "shadow"]
Message = dict  # {"role": "system"|"user"|"assistant", "content": str}


@dataclass(frozen=True)
class Prompt:
    """A prompt as the engine will see it: rendered text, its token ids, and the chat messages if any."""

    text: str
    tokens: tuple[int, ...]
    messages: tuple[Message, ...] | None = None
    approx_tokens: bool = False       # token ids come from an approximate tokenizer
    segments: tuple[int, ...] = ()    # where each segment (instruction, passages, question) starts in tokens;
                                      # () when the text held no blend separator (kvbridge.engine.segments)


@dataclass
class EngineReport:
    """What the engine itself said about one request; filled by Backend.generate while it streams."""

    engine_cached_tokens: int | None = None   # the engine's own count of reused prompt tokens
    engine_prefill_tokens: int | None = None  # tokens the engine says it evaluated
    prompt_tokens: int | None = None          # the engine's own prompt-token count
    completion_tokens: int | None = None
    prefill_ms: float | None = None           # the engine's time evaluating the prompt tokens (kvbridge.engine.stages)
    first_token_ms: float | None = None       # from the end of that prefill to the first piece; None: the caller's rest
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Sampling:
    """The sampler both llama.cpp engines use, spelled once: greedy (top-k 1) at temperature 0, else
    llama.cpp's usual top-k 40 / top-p 0.95; no min-p and no repeat penalty, so both engines agree."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float = 0.0
    repeat_penalty: float = 1.0

    @classmethod
    def for_temperature(cls, temperature: float) -> "Sampling":
        if temperature > 0:
            return cls(temperature=temperature, top_k=40, top_p=0.95)
        return cls(temperature=temperature, top_k=1, top_p=1.0)


@dataclass(frozen=True)
class SeqState:
    """One sequence's KV as the engine serialises it (llama.cpp `llama_state_seq_get_data` bytes)."""

    data: bytes | memoryview   # bytes-like; restore paths must not assume `bytes`
    n_tokens: int
    # The token ids whose KV `data` holds, as the engine itself reports them (llama-server: the slot
    # file's ids; in-process: the context's ids). None: the engine cannot say; (): the engine says the
    # state is another client's (llama-server by name: its slot ran another task). Neither is stored.
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class WindowCapture:
    """A sliding-window model's window rows at an earlier position (Backend.capture_window)."""

    data: bytes | memoryview     # llama.cpp state bytes
    whole_state: bool            # True: a whole iSWA state (a slot file), whose second cache is the window
    trusted_end: int             # rows of positions below this are the ones the prefill computed


class Backend:
    """An engine adapter. Subclasses set `key` and `kv_mode`, and implement the methods below.

    Full-KV engines (`kv_mode = "full"`) also implement save_state/restore_state/kv_fingerprint.
    """

    key: ClassVar[str] = ""
    kv_mode: ClassVar[KVMode] = "shadow"
    # True when state_buffer() hands out the engine's own memory (then KVBridge keeps no assembly buffer)
    assembles_in_place: ClassVar[bool] = False
    prompts_leave_machine: ClassVar[bool] = False  # True: prompts go to another party (the GUI shows a notice)
    # True: generate() can prefill in chunk-aligned steps and keep the recurrent state at each boundary
    # (boundary_state), which a recurrent or hybrid model's chunks need
    captures_recurrent: ClassVar[bool] = False
    boundary_step = 0   # set by CachedEngine: capture every this many prompt tokens (0: never)

    def __init__(self, settings: Settings):
        self.settings = settings
        # Events an adapter counts (retries, malformed stream lines, template fallbacks); CachedEngine
        # moves them into its Metrics after every request (take_counters), the one place metrics live.
        self.counters: Counter[str] = Counter()

    def take_counters(self) -> dict[str, int]:
        """The adapter's counts since the last call, and reset them (in place: helpers such as the chat
        template hold a reference to this Counter)."""
        counts = dict(self.counters)
        self.counters.clear()
        return counts

    @classmethod
    def settings_problems(cls, settings: Settings, environ: Mapping[str, str]) -> list[str]:
        """This engine's own checks, run by Settings.validate() after the general ones.

        Messages are written for a person and name the KVB_ variable to change; never raises.
        """
        return []

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model / start or reach the server. Raises EngineUnavailable with a clear message."""

    def stop(self) -> None:
        """Release everything start() took (contexts, child processes)."""

    def restart(self) -> None:
        """Drop the engine's context or process and start afresh; the store is not touched."""
        self.stop()
        self.start()

    def describe(self) -> str:
        """Where the engine runs, for the status line (a path or URL; never a secret)."""
        return self.key

    # prompts -------------------------------------------------------------------------------
    def render(self, messages: Sequence[Message]) -> str:
        """Chat messages -> the prompt text the engine evaluates (its chat template; ChatML here)."""
        return chatml(messages)

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, tokens: Sequence[int]) -> str:
        raise NotImplementedError

    # generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        *,
        n_predict: int,
        temperature: float,
        use_native_cache: bool,
        report: EngineReport,
    ) -> Iterator[str]:
        """Stream generated text pieces; the first yield marks TTFT.

        `use_native_cache=False` must defeat the engine's own prefix cache (cold mode) and say how in
        report.notes. Full engines evaluate only the tokens past what is already in their context.
        """
        raise NotImplementedError

    def reset_native_cache(self) -> None:
        """Drop the engine's own in-context prefix cache."""

    # full KV access (kv_mode == "full") ----------------------------------------------------
    def kv_fingerprint(self) -> dict[str, str]:
        """Everything that makes this engine's KV incompatible with another's (goes into the namespace).

        Shadow engines keep no KV; their namespace only has to separate one model/endpoint's index from another's.
        """
        return {"engine": self.key, "where": self.describe()}

    def model_file(self) -> Path | None:
        """The local model file whose sha256 goes into the namespace (None when the engine has none here)."""
        return None

    def save_state(self) -> SeqState:
        """The current sequence's KV (prompt and generated tokens) as engine bytes, with the token ids the
        engine itself says those cells hold (SeqState.token_ids): KVBridge stores nothing they do not confirm."""
        raise NotImplementedError

    def model_traits(self) -> "ModelTraits | None":
        """What llama.cpp says about the model (architecture, sliding window, recurrent, hybrid); None when
        this engine cannot tell, which a full engine treats as a refusal (kvbridge.formats.architectures)."""
        return None

    def capture_window(self, n_tokens: int) -> WindowCapture | None:
        """Sliding-window models: the sliding-window rows the context holds for the window ending at position
        n_tokens - 1, after truncating the context to its first n_tokens (later cells are dropped: call it
        with decreasing n_tokens, after save_state). None: this engine cannot (nothing of the window is
        stored then that the state alone does not hold)."""
        return None

    def boundary_state(self, n_tokens: int) -> "bytes | memoryview | None":
        """Recurrent and hybrid models: the recurrent state the last generate() captured after its prompt's first
        n_tokens (llama.cpp state bytes with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), or None when it took none
        there. The in-process engine prefills these models chunk by chunk and captures where each chunk ends; the
        scheduler also one token before the prompt's end."""
        return None

    @property
    def kv_by_reference(self) -> bool:
        """True when save_state() returns a reference to bytes kept elsewhere (they cannot be parsed here)."""
        return False

    def state_buffer(self, size: int, tokens: Sequence[int]):
        """Optional: a writable uint8 buffer of `size` bytes to assemble the next restore state into.

        An engine that must copy the state somewhere anyway (llama-server: a slot file) returns that
        place, saving one copy; None (the default) lets the engine use its own reusable buffer.
        """
        return None

    def reuse_last_restore(self, tokens: Sequence[int]) -> bool:
        """Optional: load again, without new bytes, the state of the previous restore when it starts with
        `tokens` (llama-server keeps that state in its restore file). False: not possible here."""
        return False

    def restore_state(self, state: SeqState, tokens: Sequence[int]) -> None:
        """Load `state` (covering exactly `tokens`) so the next generate() evaluates only the rest.

        Whatever the engine's context held before is replaced (the engine relies on this: lmcache mode
        models an engine whose own cache was evicted).
        """
        raise NotImplementedError

    def held_tokens(self) -> int | None:
        """How many positions the engine itself says its context holds for our sequence, read from the
        engine (llama.cpp: the sequence's position range), not from our own bookkeeping.

        CachedEngine compares it with what it restored; None: this engine cannot tell.
        """
        return None

    def context_tokens(self) -> list[int]:
        """Token ids whose KV the engine's context holds now (full engines)."""
        raise NotImplementedError
