"""Run configs: `configs/NAME.py` files with `get_config()` returning an ml_collections ConfigDict, plus
command-line overrides `--config.a.b=value` checked against the keys the recipe defines.

Every value has one home (the recipe file); an override may only change an existing key, and its type
must match, so a typo fails loudly with the nearest valid keys instead of being silently ignored.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import pathlib
from typing import Any

import ml_collections

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    pass


def available_configs(directory: pathlib.Path = CONFIG_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.py") if not p.stem.startswith("_"))


def load_config(name_or_path: str, directory: pathlib.Path = CONFIG_DIR) -> ml_collections.ConfigDict:
    """A recipe by name (`bepa_cpu`) or by path to a .py file defining get_config()."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".py":
        path = directory / f"{name_or_path}.py"
    if not path.exists():
        raise ConfigError(f"unknown config {name_or_path!r}; available configs: {', '.join(available_configs(directory))}")
    spec = importlib.util.spec_from_file_location(f"guijax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config()")
    config = module.get_config()
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config() must return an ml_collections.ConfigDict, got {type(config).__name__}")
    return config


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        full = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            keys.extend(flat_keys(value, full + "."))
        else:
            keys.append(full)
    return keys


def _parse_value(text: str, current: Any, key: str) -> Any:
    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"override {key}={text!r}: expected a bool (true/false)")
    if isinstance(current, str) or current is None:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"override {key}={text!r}: expected a {type(current).__name__}") from None
    if isinstance(current, float) and isinstance(value, int):
        value = float(value)
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(current, (tuple, list)) and not isinstance(value, (tuple, list)):
        value = (value,) if isinstance(current, tuple) else [value]
    if not isinstance(value, type(current)):
        raise ConfigError(f"override {key}={text!r}: expected a {type(current).__name__}, got {type(value).__name__}")
    return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> ml_collections.ConfigDict:
    """Apply `a.b=value` overrides in order; unknown keys fail naming the closest valid ones."""
    valid = flat_keys(config)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, text = item.split("=", 1)
        if key not in valid:
            near = difflib.get_close_matches(key, valid, n=5, cutoff=0.4)
            prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
            siblings = [k for k in valid if k.startswith(prefix)][:12] if prefix else []
            hint = near or siblings or valid[:12]
            raise ConfigError(f"unknown config key {key!r}; did you mean one of: {', '.join(hint)}")
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = _parse_value(text, node[leaf], key)
    return config


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)
