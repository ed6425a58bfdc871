"""Every engine implements `serving.interface.Engine`. mypy checks the signatures (serving/_protocol_check.py);
these tests check what it cannot: the check covers every method, a live engine passes the protocol's
runtime check, and the vLLM backend imports without vLLM."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import serving._protocol_check
from serving.engine import EmbeddedEngine
from serving.interface import Engine


def test_the_typed_check_covers_every_protocol_method():
    """Each method is passed by name to mypy's check of parameter names; one added to the protocol goes there too."""
    methods = {name for name, value in vars(Engine).items() if inspect.isfunction(value) and not name.startswith("_")}
    checked = re.findall(r"_takes\(p\.(\w+)\)\(e\.\1\)", inspect.getsource(serving._protocol_check))
    assert sorted(checked) == sorted(methods)


def test_a_live_engine_is_an_engine():
    eng = EmbeddedEngine(max_batch=1, max_model_len=16, start_thread=False)
    try:
        assert isinstance(eng, Engine)
    finally:
        eng.shutdown()


def test_the_vllm_backend_imports_without_loading_vllm():
    code = "import sys, serving.vllm_engine, serving._protocol_check; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
