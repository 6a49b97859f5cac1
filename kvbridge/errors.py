"""The small exception hierarchy: errors a person must act on carry a message written for them.

Internal storage faults never surface here: the store turns them into counted misses.
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
