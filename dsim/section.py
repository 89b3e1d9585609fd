"""What a config section is made of: `key(...)`, the declaration of one setting, and ConfigError.

The bottom of the config layers: each component's section (dsim/parallel/config.py, dsim/optim/config.py, ...)
declares its keys with `key` and raises ConfigError for a value it cannot run with; dsim.config composes the
sections, loads the YAML and checks the rules between sections. Imports nothing of dsim.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field


class ConfigError(ValueError):
    """A configuration that cannot be run."""


def key(default=dataclasses.MISSING, doc: str = "", allowed=None, *, factory=None):
    """A config key: its default, one line of meaning, and its allowed values when the type leaves them open (a
    string, or a function giving the names of a registry). `python -m dsim.config_reference` prints them all."""
    meta = {"doc": doc, "allowed": allowed}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def need(ok: bool, name: str, allowed: str, value) -> None:
    """Raise the one line naming a key, its allowed values and the value given, unless ok."""
    if not ok:
        raise ConfigError(f"config: {name} must be {allowed}, got {value!r}")
