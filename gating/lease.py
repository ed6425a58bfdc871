"""The gate's side of its lease (`registry.gate_lease`): beat while the gate is alive and moving.

`GateLease(registry, beat_s, stuck_s)` beats `registry.beat_gate` under `gate_id` (default
`<host>-<pid>`): once at `start()`, then from a background thread every `beat_s`, so the lease is kept
while the main loop is busy in a long step (an offline evaluation takes minutes on a real model). The
main loop calls `progress()` at every turn; it beats too when a beat is due. `stop()` (or leaving the
`with` block) stops the thread and releases the lease: a gate that stops is no longer watching.

A hung gate (alive, its main loop stuck in a call that never returns) would keep a bare thread
beating forever, and its canary would keep its users unwatched. So the thread beats only while the
main loop made progress within `stuck_s`; past that it logs an ERROR once and lets the lease lapse,
and beats again (WARNING) once the loop moves. `stuck_s` bounds how long one step may take: a canary
step reads the bus and scores a batch (seconds); an offline evaluation is longer, but while one runs
no version is in canary (one version in flight at a time), so a lapse then routes nobody differently.
A killed gate stops beating at once; either way gateways stop routing users to the canary within the
lease (`LAPSE_AFTER` beats) plus their cache of the canary (`api.fleet.CANARY_TTL_S`).

The thread shares the gate's `Registry` (thread-safe). A beat that fails (the database unreachable) is
logged and retried at the next one; the lease lapses if they keep failing, as it should.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Self

from registry.gate_lease import LAPSE_AFTER
from registry.registry import Registry

log = logging.getLogger(__name__)


class GateLease:
    def __init__(
        self,
        registry: Registry,
        beat_s: float = 5.0,
        stuck_s: float = 300.0,
        *,
        gate_id: str | None = None,
    ):
        if not beat_s > 0 or not stuck_s > 0:
            raise ValueError(f"beat_s {beat_s!r} and stuck_s {stuck_s!r} must be > 0")
        self.registry, self.beat_s, self.stuck_s = registry, beat_s, stuck_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.gate_id = gate_id or f"{self.host}-{self.pid}"
        self.beats = 0  # beats written
        self.failures = 0  # beats that failed
        self.stuck = False  # the thread is holding back: the main loop has not moved for stuck_s
        self._moved = self._tried_at = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lease_s(self) -> float:
        return LAPSE_AFTER * self.beat_s

    def beat(self) -> bool:
        """Renew the lease now; False (logged) if the registry refused."""
        with self._lock:
            self._tried_at = time.monotonic()
            try:
                self.registry.beat_gate(self.gate_id, host=self.host, pid=self.pid, beat_s=self.beat_s)
            except Exception as e:
                self.failures += 1
                log.warning("gate: lease beat %d of %s failed: %r", self.beats + self.failures, self.gate_id, e)
                return False
            self.beats += 1
            return True

    def progress(self) -> None:
        """The main loop moved on: the thread may beat; beat now if one is due."""
        self._moved = time.monotonic()
        was_stuck, self.stuck = self.stuck, False
        if was_stuck:
            log.warning("gate: main loop of %s moving again; renewing its lease", self.gate_id)
        if was_stuck or self._moved - self._tried_at >= self.beat_s:
            self.beat()

    def start(self) -> Self:
        """First beat (a gate that restarts resumes its canary at once), then the beating thread."""
        if self._thread is not None:
            raise RuntimeError(f"lease {self.gate_id} is started already")
        try:
            self.registry.forget_lapsed_gates()
        except Exception:
            log.exception("gate: could not forget lapsed leases")
        self._moved = time.monotonic()
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"gate-lease-{self.gate_id}", daemon=True)
        self._thread.start()
        log.info("gate: lease %s beating every %g s (lapses after %g s)", self.gate_id, self.beat_s, self.lease_s)
        return self

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self._tried_at + self.beat_s - time.monotonic())):
            if time.monotonic() - self._moved > self.stuck_s:
                if not self.stuck:
                    self.stuck = True
                    log.error(
                        "gate: main loop of %s has not moved for %.1f s (stuck_s %g): letting its lease lapse",
                        self.gate_id,
                        time.monotonic() - self._moved,
                        self.stuck_s,
                    )
                self._tried_at = time.monotonic()  # look again in beat_s
                continue
            self.beat()

    def stop(self, release: bool = True) -> None:
        """Stop beating; `release`: drop the lease now rather than let it lapse."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 + self.beat_s)
            self._thread = None
        if release:
            try:
                self.registry.release_gate(self.gate_id)
            except Exception:
                log.exception("gate: could not release lease %s", self.gate_id)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
