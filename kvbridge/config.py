"""Compatibility name for kvbridge.settings: `from kvbridge.config import Settings` keeps working.

New code imports from kvbridge.settings; this module only re-exports it.
"""
from kvbridge.settings import *  # noqa: F401,F403
from kvbridge.settings import __all__  # noqa: F401
