"""The fleet routes a live request to the replica with the fewest live requests in flight (ties round robin)."""

from serving.engine import EmbeddedEngine
from serving.fleet import Fleet
from serving.sampling import SamplingParams


def test_a_request_goes_to_the_replica_with_the_fewest_live_requests_in_flight(tiny_checkpoint):
    # Loops not started: every request stays in flight, so the counts the fleet routes by hold still.
    engines = [EmbeddedEngine(max_batch=4, max_model_len=64, start_thread=False) for _ in range(2)]
    e0, e1 = engines
    for e in engines:
        e.add_version("v1", tiny_checkpoint, default=True)
    fleet = Fleet(engines)
    sp = SamplingParams(max_tokens=4)
    try:
        fleet.lend(e1)  # two requests while only e0 serves live traffic
        fleet.submit([1, 5, 6], sp)
        fleet.submit([1, 5, 6], sp)
        fleet.reclaim(e1)
        assert (fleet.live_in_flight(e0), fleet.live_in_flight(e1)) == (2, 0)
        # Round robin alone would send the next of these to e0; the less loaded e1 takes both.
        fleet.submit([1, 5, 6], sp)
        fleet.submit([1, 5, 6], sp)
        assert (fleet.live_in_flight(e0), fleet.live_in_flight(e1)) == (2, 2)
        # Tied again: round robin between the two.
        fleet.submit([1, 5, 6], sp)
        fleet.submit([1, 5, 6], sp)
        assert (fleet.live_in_flight(e0), fleet.live_in_flight(e1)) == (3, 3)
    finally:
        for e in engines:
            e.shutdown()
