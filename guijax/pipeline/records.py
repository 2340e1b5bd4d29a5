"""What each stage was made from, so a rerun reuses only what the current config would make again.

A stage's fingerprint hashes the values of the config keys it reads and the fingerprints of the earlier
stages it reads from. `WORKDIR/stages.json` records the fingerprint when a stage starts and again when it
ends. On a rerun a stage is reused only if its recorded fingerprint equals the current one; otherwise its
old outputs are moved to `WORKDIR/stale/` (nothing is deleted) and it runs again. Because a fingerprint
includes its upstream fingerprints, a changed stage makes everything that reads from it run again too.

Keys that cannot change a result (worker counts, timeouts, checkpoint cadence, where the compile cache is)
are left out, so changing them reuses everything. A key the record lacks (one added to guijax after the stage
ran) counts as unchanged while it holds its schema default, so upgrading does not rerun finished work.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import shutil
import time
from typing import Any, Iterable, Mapping

import ml_collections

from envs.atomic import write_text_atomic

# config keys that change how a stage runs but not what it produces
NOT_RESULTS = frozenset({
    "env.num_workers", "env.timeout_s", "env.server_urls", "env.server_token_env", "env.cache_dirs",
    "train.checkpoint_every", "train.keep_checkpoints", "sft.checkpoint_every", "pipeline.worker_count",
    "model.remat",
})
LEDGER = "stages.json"
STALE_DIR = "stale"


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """The config values a stage reads (flattened to dotted keys) and the fingerprints of its upstream stages."""

    config: Mapping[str, Any]
    upstream: Mapping[str, str]

    @property
    def hash(self) -> str:
        text = json.dumps({"config": self.config, "upstream": self.upstream}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    if isinstance(value, (ml_collections.ConfigDict, dict)):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif prefix not in NOT_RESULTS:
        out[prefix] = value


def config_values(config: ml_collections.ConfigDict, reads: Iterable[str]) -> dict[str, Any]:
    """{dotted key: value} of every key under each path in `reads` (a section or a dotted key)."""
    out: dict[str, Any] = {}
    for path in reads:
        node: Any = config
        for part in path.split("."):
            if part not in node:
                raise KeyError(f"a stage reads config key {path!r}, which the recipe does not have")
            node = node[part]
        _flatten(path, _plain(node), out)
    return out


_MISSING = object()


def _equal(a: Any, b: Any) -> bool:
    """Config values compared as the ledger stores them (JSON: tuples are lists)."""
    if a is _MISSING or b is _MISSING:
        return False
    return json.dumps(_plain(a), sort_keys=True, default=str) == json.dumps(_plain(b), sort_keys=True, default=str)


def describe_change(recorded: Mapping[str, Any], current: Fingerprint) -> str:
    """Why a recorded fingerprint differs: the keys whose values changed, or the upstream stages that did."""
    old_config, old_upstream = recorded.get("config", {}), recorded.get("upstream", {})
    changed = [f"{k} {json.dumps(old_config.get(k, '(unset)'))} -> {json.dumps(current.config.get(k, '(unset)'))}"
               for k in sorted(set(old_config) | set(current.config)) if old_config.get(k) != current.config.get(k)]
    parts = []
    if changed:
        shown = changed[:4] + ([f"{len(changed) - 4} more"] if len(changed) > 4 else [])
        parts.append("config changed: " + ", ".join(shown))
    upstream = sorted(k for k in set(old_upstream) | set(current.upstream) if old_upstream.get(k) != current.upstream.get(k))
    if upstream:
        parts.append("it reads from " + ", ".join(upstream) + ", which changed")
    return "; ".join(parts) or "its record differs from the current config"


class StageRecords:
    """The ledger of one workdir (`stages.json`) against the current config's fingerprints."""

    def __init__(self, workdir: pathlib.Path, fingerprints: Mapping[str, Fingerprint],
                 defaults: Mapping[str, Any] | None = None):
        """`defaults`: {dotted key: schema default}, for keys added after a record was written."""
        self.workdir = pathlib.Path(workdir)
        self.fingerprints = dict(fingerprints)
        self.defaults = {k: _plain(v) for k, v in (defaults or {}).items()}
        self._equated: dict[str, tuple[str, str]] = {}  # stage -> (recorded hash, current hash) taken as equal
        path = self.workdir / LEDGER
        try:
            self.ledger: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); move it away to treat every stage as unrecorded") from err

    def verdict(self, key: str, outputs_complete: bool) -> tuple[bool, str]:
        """(reuse, why) for a stage (or unit) whose outputs are or are not complete."""
        if not outputs_complete:
            return False, ""
        record, current = self.ledger.get(key), self.fingerprints[key]
        if record is None:
            self._write(key, "done")
            return True, "made before stage records were kept; taken as made from this config"
        if self._same(key, record):
            if record.get("state") != "done" or record["hash"] != current.hash:
                self._write(key, "done")  # it ended but the run stopped before recording that, or it gained keys
            return True, ""
        return False, describe_change(record, current)

    def _same(self, key: str, record: Mapping[str, Any]) -> bool:
        """Whether `record` describes what the current config makes: the same fingerprint, or one that differs
        only by keys added since (at their defaults) and by upstream stages found the same that way."""
        current = self.fingerprints[key]
        if record["hash"] == current.hash:
            return True
        old, old_upstream = record.get("config", {}), record.get("upstream", {})
        for name, value in current.config.items():
            if not _equal(old[name] if name in old else self.defaults.get(name, _MISSING), value):
                return False
        if set(old) - set(current.config) or set(old_upstream) != set(current.upstream):
            return False
        if any(old_upstream[n] != h and self._equated.get(n) != (old_upstream[n], h) for n, h in current.upstream.items()):
            return False
        self._equated[key] = (record["hash"], current.hash)
        return True

    def begin(self, key: str, outputs: Iterable[str]) -> list[str]:
        """Before a stage runs: move aside the outputs of a different recorded fingerprint (a finished or
        crashed run under another config), then record this one as started. Returns what was moved."""
        record = self.ledger.get(key)
        moved = []
        if record is not None and not self._same(key, record):
            moved = self.move_aside(key, record["hash"], outputs)
        self._write(key, "started")
        return moved

    def restart(self, key: str, outputs: Iterable[str], why: str, action: str) -> str | None:
        """`begin`, then the line that says why the stage runs again and where its old outputs went (None
        when it simply runs for the first time or resumes under its own config)."""
        moved = self.begin(key, outputs)
        stale = f"{self.workdir / STALE_DIR}/"
        if why:
            return f"{why}; {action} again" + (f" (old {', '.join(moved)} moved to {stale})" if moved else "")
        if moved:
            return f"an unfinished run under another config left {', '.join(moved)}; moved to {stale}, starting afresh"
        return None

    def end(self, key: str) -> None:
        self._write(key, "done")

    def move_aside(self, key: str, old_hash: str, outputs: Iterable[str]) -> list[str]:
        target = self.workdir / STALE_DIR / f"{key.replace('/', '_')}-{old_hash}"
        if target.exists():
            target = target.with_name(f"{target.name}-{int(time.time())}")
        moved = []
        for relative in outputs:
            source = self.workdir / relative
            if source.exists():
                destination = target / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(source), str(destination))
                moved.append(relative)
        return moved

    def _write(self, key: str, state: str) -> None:
        current = self.fingerprints[key]
        self.ledger[key] = {"hash": current.hash, "state": state, "config": dict(current.config),
                            "upstream": dict(current.upstream)}
        self.workdir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.workdir / LEDGER, json.dumps(self.ledger, indent=1, sort_keys=True, default=str))
