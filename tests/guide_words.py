"""Input and ground truth for the guide's windowed word count (include/jobs/guide_windowed_counts.py)."""

from __future__ import annotations

import json
import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
from changeover.runtime.sinks.files import LOG, log_entries
from changeover.settings import CHECKOUT

GUIDE_JOB = CHECKOUT / "include" / "jobs" / "guide_windowed_counts.py"  # tests copy it out of the checkout
START = datetime(2026, 3, 1, tzinfo=UTC)
WORDS = ["apache", "spark", "flink", "airflow", "state"]


class Words:
    """The guide job's input: JSON files of (timestamp, word, id), event time one second per file."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.files, self.random = folder, 0, random.Random(3)
        self.events: list[tuple[datetime, str]] = []
        folder.mkdir(parents=True)

    def write(self, count: int = 20, at: datetime | None = None, word: str | None = None) -> None:
        base = at or START + timedelta(seconds=self.files)
        lines = []
        for i in range(count):
            ts, chosen = base + timedelta(milliseconds=50 * i), word or self.random.choice(WORDS)
            lines.append(json.dumps({"timestamp": ts.isoformat(), "word": chosen, "id": f"{self.files}-{i}"}))
            if at is None:
                self.events.append((ts, chosen))
        self._publish("\n".join(lines) + "\n")

    def repeat_last(self) -> None:
        """The last file again under a new name, as a producer retrying its delivery would: the same events, ids
        included, which a deduplicating job counts once."""
        self._publish((self.folder / f"words-{self.files - 1:05d}.json").read_text())

    def _publish(self, text: str) -> None:
        staging = self.folder.parent / f".words-{self.files}.tmp"
        staging.write_text(text)
        os.replace(staging, self.folder / f"words-{self.files:05d}.json")
        self.files += 1

    @contextmanager
    def writing(self, interval: float = 0.5, repeats: bool = False) -> Iterator[None]:
        """A file every interval in the background: a moved job has new input to commit a batch on. With
        `repeats`, every other file is the one before it again."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                self.write()
                if repeats and not stop.wait(interval):
                    self.repeat_last()

        thread = threading.Thread(target=loop, name="words", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def truth(self) -> Counter[tuple[datetime, str]]:
        """Counts per (window start, word) for 10 s windows sliding by 5 s, as the guide's query groups them."""
        counts: Counter[tuple[datetime, str]] = Counter()
        for ts, word in self.events:
            latest = START + timedelta(seconds=((ts - START).total_seconds() // 5) * 5)
            for start in (latest - timedelta(seconds=5), latest):
                counts[(start, word)] += 1
        return counts

    def flush(self) -> None:
        """Two events far ahead: the watermark passes every window of the real events, which closes them."""
        for later in (60, 61):
            self.write(count=1, at=START + timedelta(seconds=self.files + later), word="flush")


def parquet_counts(output: Path) -> Counter[tuple[datetime, str]]:
    """What the file sink committed: only the files its `_spark_metadata` log lists, as Spark reads them."""
    counts: Counter[tuple[datetime, str]] = Counter()
    for path in log_entries(output / LOG):
        for row in pq.read_table(path).to_pylist():
            start = row["window"]["start"].replace(tzinfo=UTC)
            assert (start, row["word"]) not in counts, "a window emitted twice"
            counts[(start, row["word"])] = row["count"]
    return counts
