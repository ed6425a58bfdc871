"""mypy checks here that each engine implements `serving.interface.Engine`.

A drift from the protocol in an implementation's method or property (a missing or renamed
parameter, a lost default, a required extra parameter, another parameter or return type, a method
where the protocol has a property, an attribute where it has a read-only property) fails `mypy`
(CI runs it). A protocol match ignores the names of positional parameters, which callers may still
pass by keyword, so `_same_names` also passes each method where the protocol's own method type is
expected: an argument's type is compared with the names. Nothing runs at import: the
implementations are imported only while type checking, so this never loads vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from serving.engine import EmbeddedEngine
    from serving.engine_process import ProcessEngine
    from serving.interface import Engine
    from serving.vllm_engine import VLLMEngine

    def _embedded(e: EmbeddedEngine) -> Engine:
        return e

    def _process(e: ProcessEngine) -> Engine:
        return e

    def _vllm(e: VLLMEngine) -> Engine:
        return e

    T = TypeVar("T")
    Impl = TypeVar("Impl", EmbeddedEngine, ProcessEngine, VLLMEngine)

    def _takes(proto: T) -> Callable[[T], None]:
        """A function that accepts only what can stand for `proto`, the names of its parameters included."""
        return lambda impl: None

    def _same_names(p: Engine, e: Impl) -> None:
        """Every method of the protocol (tests/serving/test_interface.py checks that none is left out)."""
        _takes(p.add_version)(e.add_version)
        _takes(p.set_default)(e.set_default)
        _takes(p.retire_version)(e.retire_version)
        _takes(p.update_weights)(e.update_weights)
        _takes(p.submit)(e.submit)
        _takes(p.generate)(e.generate)
        _takes(p.tokenizer)(e.tokenizer)
        _takes(p.model_args)(e.model_args)
        _takes(p.context_length)(e.context_length)
        _takes(p.weights_dtype)(e.weights_dtype)
        _takes(p.shutdown)(e.shutdown)
