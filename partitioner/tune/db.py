"""The autotuner's trial store: one SQLite file, one row per measured configuration.

A row is keyed by what determines a measurement: the graph hash, the
topology hash, the configuration with its compression, the batch, precision,
optimizer and the measuring protocol (warm-up and measured steps). Each trial
is committed as soon as it ends, so an interrupted tune loses at most the
trial that was running, and a re-run with the same key reads the row instead
of measuring again. SQLite is in the standard library and safe for one
writer; the tuner is that writer.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

__all__ = ["TrialStore", "trial_key"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    key TEXT PRIMARY KEY,
    graph_hash TEXT NOT NULL,
    topology_hash TEXT NOT NULL,
    config TEXT NOT NULL,
    status TEXT NOT NULL,
    record TEXT NOT NULL,
    created REAL NOT NULL
)
"""


def trial_key(**parts: Any) -> str:
    """A stable hash of the parts (JSON with sorted keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class TrialStore:
    """Trials of every tune that used this file; `get`/`put` by key."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path)
            self._db.execute(_SCHEMA)
            self._db.commit()
        except sqlite3.DatabaseError as e:
            raise sqlite3.DatabaseError(f"autotune database {self.path}: {e}; pass another db= path or delete "
                                        "this file") from None

    def get(self, key: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT record FROM trials WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, *, graph_hash: str, topology_hash: str, config: str, status: str,
            record: dict[str, Any]) -> None:
        self._db.execute("INSERT OR REPLACE INTO trials VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (key, graph_hash, topology_hash, config, status, json.dumps(record, sort_keys=True),
                          time.time()))
        self._db.commit()

    def rows(self, *, graph_hash: str | None = None, topology_hash: str | None = None) -> list[dict[str, Any]]:
        q, args = "SELECT record FROM trials", []
        where = [(c, v) for c, v in (("graph_hash", graph_hash), ("topology_hash", topology_hash)) if v]
        if where:
            q += " WHERE " + " AND ".join(f"{c} = ?" for c, _ in where)
            args = [v for _, v in where]
        return [json.loads(r[0]) for r in self._db.execute(q + " ORDER BY created", args)]

    def close(self) -> None:
        self._db.close()
