"""A deterministic click generator: JSON files into a landing folder, and the ground truth it wrote."""

from __future__ import annotations

import json
import os
import random
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

KEYS = [f"user-{i:02d}" for i in range(12)]
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


class Generator:
    """Writes file N with EVENTS_PER_FILE events; event time advances one second per file."""

    def __init__(self, landing: Path, events_per_file: int = 40, seed: int = 7) -> None:
        self.landing = landing
        self.events_per_file = events_per_file
        self.random = random.Random(seed)
        self.files = 0
        self.truth: Counter[str] = Counter()
        self.window_truth: Counter[str] = Counter()  # "key@window start" for 10 s tumbling windows
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def write_file(self, keys: list[str] | None = None) -> None:
        """The next file: events_per_file events of random keys, or one event of each of `keys`."""
        self.landing.mkdir(parents=True, exist_ok=True)
        base = EPOCH + timedelta(seconds=self.files)
        lines = []
        for i, chosen in enumerate(keys or [None] * self.events_per_file):
            key = chosen or self.random.choice(KEYS)
            ts = base + timedelta(milliseconds=self.random.randrange(1000))
            lines.append(json.dumps({"key": key, "ts": ts.isoformat(), "seq": self.files * 1000 + i}))
            self.truth[key] += 1
            start = EPOCH + timedelta(seconds=(self.files // 10) * 10)
            self.window_truth[f"{key}@{start:%Y-%m-%d %H:%M:%S}"] += 1
        staging = self.landing.parent / f".{self.landing.name}-{self.files:06d}.tmp"
        staging.write_text("\n".join(lines) + "\n")
        os.replace(staging, self.landing / f"clicks-{self.files:06d}.json")  # appears whole to the source
        self.files += 1
        (self.landing.parent / "ground_truth.json").write_text(json.dumps({"files": self.files, "totals": self.truth}))

    def start(self, interval: float = 0.5) -> None:
        def loop() -> None:
            while not self._stop.wait(interval):
                with self._lock:
                    if self._running.is_set():
                        self.write_file()

        self._thread = threading.Thread(target=loop, name="generator", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stop writing until resume(); returns once a file being written is finished."""
        with self._lock:
            self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
