"""The feedback event's fast wire form agrees with the pydantic model it stands for."""

from __future__ import annotations

import random

import pytest

from feedback.events import FEEDBACK_KINDS, FeedbackEvent, feedback_json, hash_user, new_event_id


def random_event(rng: random.Random, text) -> dict:
    kind = rng.choice(FEEDBACK_KINDS)
    value = {"rating": float(rng.randint(1, 5)), "edited": rng.random(), "dwell": rng.uniform(0, 86400)}.get(kind)
    return {"event_id": new_event_id(), "tenant": text(rng), "ts": rng.choice([rng.uniform(1e9, 2e9), 1.5, 1e-3]),
            "completion_id": text(rng), "user_id": rng.choice([None, hash_user("t", text(rng))]), "kind": kind,
            "value": value, "edit_distance": rng.randint(0, 500) if kind == "edited" and rng.random() < 0.5 else None}


def ascii_text(rng):
    return "".join(rng.choice("abcXYZ019-_.:/ ") for _ in range(rng.randint(1, 40)))


def any_text(rng):
    return "".join(rng.choice(['a', '"', "\\", "\n", "\t", "\x00", "\u00e9", "\u4e2d", "\U0001F600", "/"])
                   for _ in range(rng.randint(1, 20)))


def test_fast_wire_form_is_the_models_bytes_for_ascii_fields():
    rng = random.Random(0)
    for _ in range(2000):
        fields = random_event(rng, ascii_text)
        assert feedback_json(**fields) == FeedbackEvent(**fields).model_dump_json().encode()


@pytest.mark.parametrize("seed", range(3))
def test_fast_wire_form_parses_back_to_the_same_event_for_any_text(seed):
    rng = random.Random(seed)
    for _ in range(500):
        fields = random_event(rng, any_text)
        assert FeedbackEvent.model_validate_json(feedback_json(**fields)) == FeedbackEvent(**fields)
