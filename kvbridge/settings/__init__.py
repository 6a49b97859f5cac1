"""The settings layer: one frozen `Settings`, its checks, the `.env` writer and the cloud presets.

The first step of every run (environment + `.env` -> Settings -> validate()). This package imports
nothing of the engine, the store or the adapters: the names KVB_ENGINE and the tiers' codecs may take
live here, in tables the higher layers fill (`engines`, filled by kvbridge.backends.registry, and
`codecs`, filled by kvbridge.store.serde), each loading its built-in modules by name on first lookup.
"""
from kvbridge.settings.checks import url_problem
from kvbridge.settings.core import (DEFAULT_ENV_FILE, EMBEDDED_MODEL_FILE, EMBEDDED_MODEL_PATH, PATH_FIELDS,
                                    SETTING_NAMES, SIZE_FIELDS, Problems, Settings, env_name, format_size, parse_size,
                                    setting_fields, settings_to_env)
from kvbridge.settings.envfile import is_variable_name, looks_like_secret, update_env_file
from kvbridge.settings.paths import DATA_HOME, SOURCE_CHECKOUT, WORK_DIR, setup_command
from kvbridge.settings.presets import CLOUD_PRESETS, CloudPreset

__all__ = [
    "CLOUD_PRESETS", "DATA_HOME", "DEFAULT_ENV_FILE", "EMBEDDED_MODEL_FILE", "EMBEDDED_MODEL_PATH", "PATH_FIELDS",
    "Problems", "SETTING_NAMES", "SIZE_FIELDS", "SOURCE_CHECKOUT", "WORK_DIR", "CloudPreset", "Settings",
    "env_name", "format_size", "is_variable_name", "looks_like_secret", "parse_size", "setting_fields",
    "settings_to_env", "setup_command", "update_env_file", "url_problem",
]
