"""Event construction: the feedback event the gateway publishes, and the ids keys stand for."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from feedback.events import FeedbackEvent, event_id_for


def received(**kw) -> FeedbackEvent:
    args = {
        "event_id": "e" * 32,
        "tenant": "t",
        "completion_id": "c",
        "kind": "copied",
        "value": None,
        "edit_distance": None,
        "client_ts": None,
        "now": 200.0,
        "served_ts": 100.0,
        "served_user": "u-hash",
    }
    return FeedbackEvent.received(**{**args, **kw})


@pytest.mark.parametrize(("client_ts", "ts"), [(None, 200.0), (50.0, 100.0), (150.0, 150.0), (1e12, 200.0)])
def test_a_received_event_has_the_gateways_time_or_the_clients_clamped(client_ts, ts):
    assert received(client_ts=client_ts).ts == ts


def test_a_received_event_is_the_completions_users_and_checks_its_value():
    assert received().user_id == "u-hash" and received(served_user=None).user_id is None
    assert received(kind="rating", value=4).value == 4.0
    with pytest.raises(ValidationError, match="rating needs an integer value"):
        received(kind="rating", value=7)


def test_event_ids_of_idempotency_keys_are_stable_and_per_tenant():
    assert event_id_for("t", "k") == event_id_for("t", "k") != event_id_for("u", "k")
    assert event_id_for("default", "k1") == "eb9bc74ce18b567169ffb321dc5a19c0"  # pinned: ids on a bus stay valid
