"""Every engine implements `serving.interface.Engine`: the protocol's methods and properties exist on
each implementation, with signatures a caller of the protocol can use unchanged."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from serving.engine import EmbeddedEngine
from serving.engine_process import ProcessEngine
from serving.interface import Engine
from serving.vllm_engine import VLLMEngine  # imports vLLM only inside its methods (checked below)

IMPLEMENTATIONS = [EmbeddedEngine, ProcessEngine, VLLMEngine]
_OPTIONAL_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def protocol_members() -> dict[str, object]:
    """The protocol's public methods and properties, by name."""
    return {
        name: value
        for name, value in vars(Engine).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }


def incompatibility(proto: inspect.Signature, impl: inspect.Signature) -> str | None:
    """Why a call written against `proto` could fail on `impl` (None: it cannot). Each protocol
    parameter must be at the same position with the same name and kind, and keep its default;
    parameters the implementation adds must be optional; return annotations, where both give one,
    must be the same."""
    ours, theirs = list(proto.parameters.values()), list(impl.parameters.values())
    for i, p in enumerate(ours):
        if i >= len(theirs):
            return f"parameter {p.name!r} is missing"
        q = theirs[i]
        if (q.name, q.kind) != (p.name, p.kind):
            return f"parameter {i} is {q.name!r} ({q.kind.description}), not {p.name!r} ({p.kind.description})"
        if p.default is not p.empty and q.default != p.default:
            return f"parameter {p.name!r} defaults to {q.default!r}, not {p.default!r}"
    for q in theirs[len(ours) :]:
        if q.default is q.empty and q.kind not in _OPTIONAL_KINDS:
            return f"added parameter {q.name!r} is required"
    if (
        proto.return_annotation is not proto.empty
        and impl.return_annotation is not impl.empty
        and proto.return_annotation != impl.return_annotation
    ):
        return f"returns {impl.return_annotation!r}, not {proto.return_annotation!r}"
    return None


def test_the_protocol_declares_the_engine_surface():
    assert {
        "default_version",
        "versions",
        "alive",
        "add_version",
        "set_default",
        "retire_version",
        "update_weights",
        "submit",
        "generate",
        "tokenizer",
        "model_args",
        "context_length",
        "shutdown",
    } <= set(protocol_members())


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(protocol_members()))
def test_implementation_matches_the_protocol(impl, name):
    want = protocol_members()[name]
    got = inspect.getattr_static(impl, name, None)
    assert got is not None, f"{impl.__name__} has no {name}"
    if isinstance(want, property):
        assert isinstance(got, property), f"{impl.__name__}.{name} is not a property"
        want, got = want.fget, got.fget
    assert inspect.isfunction(got), f"{impl.__name__}.{name} is not a method"
    why = incompatibility(inspect.signature(want), inspect.signature(got))
    assert why is None, f"{impl.__name__}.{name}: {why}"


def test_the_protocol_has_no_plain_attributes():
    """`default_version` is a read-only property: the default changes only through `set_default`,
    which checks the version is loaded and not retired (and tells the engine process)."""
    assert not getattr(Engine, "__annotations__", {})


def test_a_live_engine_is_an_engine():
    eng = EmbeddedEngine(max_batch=1, max_model_len=16, start_thread=False)
    try:
        assert isinstance(eng, Engine)
    finally:
        eng.shutdown()


def test_the_checker_catches_mismatches():
    def proto(self, name: str, version: str | None = None) -> int: ...
    def renamed(self, name: str, ver: str | None = None) -> int: ...
    def no_default(self, name: str, version: str | None) -> int: ...
    def extra_required(self, name: str, version: str | None = None, *, flag: bool) -> int: ...
    def other_return(self, name: str, version: str | None = None) -> str: ...
    def wider(self, name: str, version: str | None = None, extra: int = 0, **kw) -> int: ...

    sig = inspect.signature
    for bad in (renamed, no_default, extra_required, other_return):
        assert incompatibility(sig(proto), sig(bad)) is not None, bad.__name__
    assert incompatibility(sig(proto), sig(wider)) is None


def test_the_vllm_backend_imports_without_loading_vllm():
    code = "import sys, serving.vllm_engine; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
