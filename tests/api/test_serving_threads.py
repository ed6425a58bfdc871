"""The default torch threads of a gateway's engine process (`api.main.serving_threads`)."""

import os

from api.main import serving_threads


def test_one_thread_on_two_cores_or_fewer_two_beyond(monkeypatch):
    for cores, want in ((1, 1), (2, 1), (3, 2), (16, 2)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert serving_threads() == want, cores
