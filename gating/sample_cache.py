"""The offline gate's samples of a version, kept so that a version is sampled on a suite once.

The gate's samples are deterministic: each has its own seed (`gating.evals.sample_seed`) and the
embedded engine decodes batch-invariantly, so a version's completions of a suite at given sampling
settings are a function of its weights and of the request. `SampleCache` keys them by exactly that:
the version's artifact sha256 and a hash of every prompt's ids and sampling parameters
(`request_key`). Then a gate cycle samples only the candidate: the incumbent's (and the anchor's)
completions were made when each was a candidate, or at its first evaluation, and are read back. A
different suite, G, seed, length or temperature is a different key, so nothing stale is reused. On an
engine that is not batch-invariant (vLLM) a cached completion is still a sample of that version, just
not the one a fresh call would give bit for bit.

One JSON file per key under the folder, written to a temporary name and renamed into place, so a
killed gate leaves either the whole entry or none. A missing, unreadable or mismatched entry is a miss
(logged, and counted by the caller), never an error: the caller samples afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from serving.requests import Completion
from serving.sampling import SamplingParams

log = logging.getLogger(__name__)

FORMAT = 1


def request_key(artifact_sha256: str, prompt_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> str:
    """The cache key of sampling `prompt_ids` with `params` (one per prompt) from the artifact."""
    if len(prompt_ids) != len(params):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(params)} sampling parameters")
    h = hashlib.sha256()
    h.update(f"{FORMAT}:{artifact_sha256}".encode())
    for ids, p in zip(prompt_ids, params, strict=True):
        h.update(json.dumps([list(ids), dataclasses.asdict(p)], sort_keys=True).encode())
    return h.hexdigest()


class SampleCache:
    """Completions on disk by `request_key`; see the module docstring."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def has(self, key: str) -> bool:
        """Whether an entry for `key` exists (not whether it reads back: `get` checks that)."""
        return self._path(key).is_file()

    def get(
        self, key: str, prompt_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams], version: str
    ) -> list[Completion] | None:
        """The stored completions for `key`, as `Completion`s of `version` (no routing: the gate does not
        use it), or None on a miss."""
        path = self._path(key)
        try:
            rows = json.loads(path.read_text())["completions"]
            if len(rows) != len(prompt_ids):
                raise ValueError(f"{len(rows)} completions stored for {len(prompt_ids)} prompts")
            out = [
                Completion(
                    request_id=f"cache-{key[:12]}-{i}",
                    version=version,
                    prompt_ids=list(ids),
                    output_ids=[int(t) for t in r["output_ids"]],
                    logprobs=[float(x) for x in r["logprobs"]],
                    routed_experts=np.zeros((0, 0, 0), dtype=np.uint8),
                    text=str(r["text"]),
                    finish_reason=str(r["finish_reason"]),
                    params=p,
                )
                for i, (r, ids, p) in enumerate(zip(rows, prompt_ids, params, strict=True))
            ]
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.misses += 1
            log.warning("gate: sample cache entry %s is unreadable (%s); sampling afresh", path, e)
            return None
        self.hits += 1
        return out

    def put(self, key: str, completions: Sequence[Completion]) -> None:
        """Store `completions` under `key` (atomically: a temporary file renamed into place)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        rows = [
            {"output_ids": c.output_ids, "logprobs": c.logprobs, "text": c.text, "finish_reason": c.finish_reason}
            for c in completions
        ]
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"format": FORMAT, "completions": rows}))
        os.replace(tmp, path)
