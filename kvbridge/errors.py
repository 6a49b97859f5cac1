"""The small exception hierarchy: errors a person must act on carry a message written for them.

Internal storage faults never surface to a user: the store raises `StoreFault` (kvbridge.store),
the byte formats `LayoutError` / `SlotFileError` (kvbridge.formats), an engine that refuses or cannot
produce a KV state `StateTransferError` (here); CachedEngine catches exactly these and turns them
into a counted miss or a skipped store, so any other exception is a bug that fails its tests.
"""


class KVBridgeError(Exception):
    """Base of every error KVBridge raises on purpose."""


class BadSettings(KVBridgeError):
    """A setting or file is wrong; the message names the variable or path."""


class EngineUnavailable(KVBridgeError):
    """The engine cannot be reached or started (model missing, server down, port in use)."""


class NeedsKey(KVBridgeError):
    """A cloud engine needs an API key in the variable named by KVB_CLOUD_API_KEY_ENV."""


class BudgetExhausted(KVBridgeError):
    """The cloud token budget (KVB_CLOUD_TOKEN_BUDGET) is used up; requests are refused."""


class UnknownEngineError(KVBridgeError, KeyError):
    """resolve_engine() got a name that is neither a registered key nor an alias."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else "unknown engine"


class StateTransferError(KVBridgeError):
    """The engine refused a KV state we restored, or could not hand one over to be stored.

    CachedEngine recomputes the prompt (restore) or skips the store (save) and counts it.
    """


class EmptyPrompt(BadSettings):
    """A prompt with no tokens: there is nothing to prefill or to answer."""


class RequestFailed(KVBridgeError):
    """A request ended with record.error set; RequestRecord.raise_for_error() raises it with that message."""

    def __init__(self, message: str, record=None) -> None:
        super().__init__(message)
        self.record = record   # the RequestRecord: its timings and notes up to the failure
