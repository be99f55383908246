"""What one Locust run measures, without importing Locust: its configuration (passed to the Locust process as a
JSON file), the per-request records taken after the warm-up, the server snapshots at the start and end of the
measured window, and Locust's own counts. The locustfile only wires these to Locust's events.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .metrics import Snapshot

__all__ = ["RequestRecord", "RunConfig", "RunRecorder", "RunResult"]

ENV_VAR = "LOADTEST_CONFIG"


@dataclass
class RunConfig:
    column: str  # plain | integrated (VC comparison), or tts_stream | tts | vc_stream (the TTS column)
    protocol: str  # http | grpc
    url: str  # host:port of ``protocol``
    http_url: str  # host:port of the server's HTTP endpoint (statistics)
    metrics_url: str  # http://host:port/metrics
    workload: str  # .npz of :mod:`.workload`
    out: str  # where the locustfile writes the :class:`RunResult` JSON
    users: int = 10
    target_requests: int = 200  # measured requests; then the run stops (users finish what they are doing)
    warmup_requests: int = 10  # completions after all users are spawned that are left out of the figures
    seed: int = 0
    timeout_s: float = 600.0  # per request
    # The model whose nv_inference_request_success counts the conversions (the ensemble; for the plain column,
    # the stage each conversion calls last) and how many of its requests one conversion makes.
    check_model: str = "cosyvoice_vc"
    calls_per_request: int = 1
    model_dir: str = ""  # the plain client's front end reads its cosyvoice2.yaml ("" : the official settings)
    chunk_model: str = ""  # streams: the model each audio chunk calls once (its success counter counts chunks)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        return cls(**json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class RequestRecord:
    start: float  # wall clock
    latency_s: float
    audio_s: float  # seconds of audio produced (0 for a failure)
    ok: bool
    error: str = ""
    first_chunk_s: float | None = None  # streams: when the first audio chunk arrived, after the request was sent
    chunks: int = 0  # streams: audio chunks received (1 for a whole answer)


@dataclass
class RunResult:
    config: RunConfig
    records: list[RequestRecord]
    begin: Snapshot | None
    end: Snapshot | None
    locust_requests: int = 0  # Locust's own count (after its reset), failures included
    locust_failures: int = 0
    warmup_completed: int = 0
    target_reached: bool = False
    locust_errors: dict[str, int] = field(default_factory=dict)

    @property
    def window(self) -> tuple[float, float]:
        """(start, end) wall clock of the measured window: the first snapshot (taken as the users resumed) and
        the last completion (the end snapshot waits for the server's counters to settle)."""
        if self.begin is None or self.end is None:
            return math.nan, math.nan
        last = max((r.start + r.latency_s for r in self.records), default=self.end.time)
        return self.begin.time, min(last, self.end.time)

    @property
    def duration_s(self) -> float:
        t0, t1 = self.window
        return t1 - t0

    def to_json(self) -> dict[str, Any]:
        return {"config": asdict(self.config),
                "records": [[r.start, r.latency_s, r.audio_s, r.ok, r.error, r.first_chunk_s, r.chunks]
                            for r in self.records],
                "begin": self.begin.to_json() if self.begin else None,
                "end": self.end.to_json() if self.end else None,
                "locust_requests": self.locust_requests, "locust_failures": self.locust_failures,
                "warmup_completed": self.warmup_completed, "target_reached": self.target_reached,
                "locust_errors": self.locust_errors}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunResult:
        return cls(RunConfig(**d["config"]), [_record(r) for r in d["records"]],
                   Snapshot.from_json(d["begin"]) if d.get("begin") else None,
                   Snapshot.from_json(d["end"]) if d.get("end") else None,
                   int(d.get("locust_requests", 0)), int(d.get("locust_failures", 0)),
                   int(d.get("warmup_completed", 0)), bool(d.get("target_reached", False)),
                   dict(d.get("locust_errors", {})))

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path or self.config.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> RunResult:
        return cls.from_json(json.loads(Path(path).read_text()))


def _record(row: list) -> RequestRecord:
    """A record from its JSON row (5 fields before the TTS columns, 7 since)."""
    a, b, c, ok, e, *rest = row
    first = float(rest[0]) if rest and rest[0] is not None else None
    return RequestRecord(float(a), float(b), float(c), bool(ok), str(e), first,
                         int(rest[1]) if len(rest) > 1 else 0)


class RunRecorder:
    """The state of one Locust run: warm-up, then measuring from :meth:`start_measuring` until the target is reached."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.completed = 0  # every completion since the start, warm-up included
        self.measuring = False
        self.records: list[RequestRecord] = []
        self.begin_snapshot: Snapshot | None = None
        self.warmup_completed = 0
        self.stop_requested = False

    def record(self, start: float, latency_s: float, audio_s: float, error: BaseException | str | None, *,
               first_chunk_s: float | None = None, chunks: int = 0) -> bool:
        """Note one completion; True when the target has just been reached (the caller stops the run)."""
        self.completed += 1
        if not self.measuring:
            return False
        msg = "" if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        self.records.append(RequestRecord(start, latency_s, audio_s if error is None else 0.0, error is None,
                                          msg[:300], first_chunk_s, chunks))
        if not self.stop_requested and len(self.records) >= self.config.target_requests:
            self.stop_requested = True
            return True
        return False

    def warmed_up(self) -> bool:
        return self.completed >= self.config.warmup_requests

    def start_measuring(self) -> None:
        """Count from now on (the server snapshot of this moment follows: :meth:`set_begin`)."""
        self.warmup_completed = self.completed
        self.records.clear()
        self.measuring = True

    def set_begin(self, snapshot: Snapshot) -> None:
        self.begin_snapshot = snapshot

    def result(self, end: Snapshot | None, *, locust_requests: int, locust_failures: int,
               locust_errors: dict[str, int] | None = None) -> RunResult:
        return RunResult(self.config, list(self.records), self.begin_snapshot, end, locust_requests, locust_failures,
                         self.warmup_completed, self.stop_requested, dict(locust_errors or {}))
