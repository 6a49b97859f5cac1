"""Secrets read from a variable a setting *names* (KVB_SERVE_API_KEY_ENV, KVB_SERVE_ADMIN_KEY_ENV, ...).

Settings and `.env` hold only the name of the variable; the secret itself is read here, from the
process environment, when the part that needs it starts. One home, so every such setting refuses an
empty variable with the same message naming both the setting and the variable.
"""
from __future__ import annotations

import os
from typing import Mapping

from kvbridge.errors import BadSettings


def secret_from(setting: str, variable: str, environ: Mapping[str, str] | None = None, *,
                unset_hint: str = "") -> str:
    """The value of `variable` (named by the setting `setting`); '' when `variable` is empty (no secret
    asked for). BadSettings naming both when the variable is unset or empty; `unset_hint` says how to
    need no secret instead."""
    if not variable:
        return ""
    value = (os.environ if environ is None else environ).get(variable, "")
    if not value:
        hint = f" or {unset_hint}" if unset_hint else ""
        raise BadSettings(f"{setting} names {variable}, but that variable is empty or not set; set it "
                          f"(export {variable}=...){hint}")
    return value
