"""Which model versions an engine holds, which one is the default, and when a version may go.

One `VersionTable` per engine (the embedded engine, the engine process's proxy, the vLLM
backend), so the three keep the same rules:
- a request is bound to one version when it is submitted (`acquire`; a request naming none gets
  the default of that moment) and counts as in flight on it until its last event is delivered
  (`release`). Its tokens, log-probs and routed experts all come from that version;
- `set_default` changes where new requests that name no version go; requests in flight stay where
  they are;
- `retire` refuses new requests naming the version at once (a `KeyError` saying it is retired) and
  lets the engine unload it (`drop`) once nothing is in flight on it: never under a running
  request. The default version cannot be retired: set another default first;
- `exclusive` holds a version with nothing in flight, new requests for it waiting meanwhile: the
  only way to change a version's weights in place (an in-place change under a running request
  would mix two policies in one completion). With requests in flight it raises `VersionBusy`;
  the way to serve new weights then is a new version beside the old one (`serving.swap`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from serving.kv_cache import KVCache
from serving.model import Transformer
from serving.tokenizer import Tokenizer

T = TypeVar("T")
S = TypeVar("S")  # the engine's record of one request


class VersionBusy(RuntimeError):
    """An in-place weight change refused: requests are in flight on that version."""


@dataclass
class _Entry(Generic[T]):
    value: T
    in_flight: int = 0
    retiring: bool = False
    updating: bool = False
    unloaded: threading.Event = field(default_factory=threading.Event)


class VersionTable(Generic[T]):
    """Thread-safe: submitters, the engine's loop and control calls use it from their own threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._entries: dict[str, _Entry[T]] = {}
        self._default: str | None = None

    @property
    def default(self) -> str | None:
        return self._default

    def names(self) -> list[str]:
        """Every version still loaded, retiring ones included until they are unloaded."""
        with self._cond:
            return list(self._entries)

    def values(self) -> list[T]:
        with self._cond:
            return [e.value for e in self._entries.values()]

    def _entry(self, version: str | None) -> tuple[str, _Entry[T]]:
        name = version or self._default
        entry = self._entries.get(name) if name is not None else None
        if name is None or entry is None:
            raise KeyError(f"model version {name!r} is not loaded; loaded: {sorted(self._entries)}")
        return name, entry

    def add(self, name: str, value: T, default: bool = False) -> None:
        with self._cond:
            if name in self._entries:
                state = " and retiring (it unloads once its requests end)" if self._entries[name].retiring else ""
                raise ValueError(f"model version {name!r} is already loaded{state}")
            self._entries[name] = _Entry(value)
            if default or self._default is None:
                self._default = name

    def get(self, version: str | None) -> T:
        """A loaded version (retiring or not), for its tokenizer, shapes and such."""
        with self._cond:
            return self._entry(version)[1].value

    def acquire(self, version: str | None) -> tuple[str, T]:
        """Bind one new request to `version` (or the default) and count it in flight there."""
        with self._cond:
            name, entry = self._entry(version)
            while entry.updating:  # an in-place update of an idle version: wait, then get the new weights
                self._cond.wait()
                name, entry = self._entry(name)
            if entry.retiring:
                when = f"once its {entry.in_flight} requests in flight end" if entry.in_flight else "now"
                raise KeyError(
                    f"model version {name!r} is retired: it takes no new requests (it is unloaded "
                    f"{when}); default: {self._default!r}"
                )
            entry.in_flight += 1
            return name, entry.value

    def release(self, name: str) -> bool:
        """One request bound to `name` ended. True when the version is now retiring and idle (unload it)."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is None:
                return False
            entry.in_flight = max(0, entry.in_flight - 1)
            return entry.retiring and entry.in_flight == 0

    def in_flight(self, name: str) -> int:
        with self._cond:
            return self._entry(name)[1].in_flight

    def set_default(self, name: str) -> None:
        with self._cond:
            _, entry = self._entry(name)
            if entry.retiring:
                raise KeyError(f"model version {name!r} is retired: it cannot become the default")
            self._default = name

    def retire(self, name: str) -> threading.Event:
        """Refuse new requests for `name` from now on; the returned event is set once it is unloaded.
        Retiring a retiring version again just returns its event."""
        with self._cond:
            _, entry = self._entry(name)
            if name == self._default:
                raise ValueError(
                    f"model version {name!r} is the default: set_default to another version before retiring it"
                )
            entry.retiring = True
            return entry.unloaded

    def idle_retired(self) -> list[str]:
        """Retiring versions with nothing in flight: ready to be unloaded."""
        with self._cond:
            return [n for n, e in self._entries.items() if e.retiring and e.in_flight == 0]

    def drop(self, name: str) -> T | None:
        """Forget `name` (the caller frees what it held) and wake whoever waits for it to go."""
        with self._cond:
            entry = self._entries.pop(name, None)
            if entry is None:
                return None
            if self._default == name:  # only when the engine is shutting down or dead
                self._default = None
            self._cond.notify_all()
        entry.unloaded.set()
        return entry.value

    @contextmanager
    def exclusive(self, name: str) -> Iterator[T]:
        """Hold `name` with nothing in flight on it (new requests for it wait until the block ends)."""
        with self._cond:
            _, entry = self._entry(name)
            if entry.retiring:
                raise KeyError(f"model version {name!r} is retired")
            if entry.in_flight or entry.updating:
                raise VersionBusy(
                    f"model version {name!r} has {entry.in_flight} requests in flight: changing its weights in "
                    "place would mix two policies in their completions. Load the new weights as a new version "
                    "beside it (add_version), set_default to it, then retire_version the old one "
                    "(serving.swap.hot_swap does all three)"
                )
            entry.updating = True
        try:
            yield entry.value
        finally:
            with self._cond:
                entry.updating = False
                self._cond.notify_all()


class ServedVersion(Generic[S]):
    """One version in the embedded engine: its model, tokenizer, KV cache slots and request queues."""

    def __init__(self, name: str, model: Transformer, tokenizer: Tokenizer, n_slots: int, max_len: int):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.dtype = next(model.parameters()).dtype
        # Ids past the tokenizer's vocabulary (an embedding padded for speed) are never sampled.
        self.n_vocab = min(model.args.vocab_size, tokenizer.vocab_size)
        self.cache = KVCache.empty(model.args, n_slots, max_len, dtype=self.dtype)
        self.free = list(range(n_slots - 1, -1, -1))
        self.waiting: deque[S] = deque()
        self.running: list[S] = []
