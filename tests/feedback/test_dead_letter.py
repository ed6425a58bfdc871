"""The dead-letter topic on the embedded bus: a letter names where its record came from and keeps it whole."""

from feedback.bus import Record
from feedback.bus_embedded import EmbeddedBus
from feedback.dead_letter import DEAD_LETTER_TOPIC, DeadLetter, dead_letter


def read_all(bus, group="reader"):
    consumer = bus.consumer(DEAD_LETTER_TOPIC, group)
    out = []
    while records := consumer.poll(100, timeout_s=0.2):
        out += [DeadLetter.model_validate_json(r.value) for r in records]
    consumer.close()
    return out


def test_letters_keep_the_source_the_reason_and_the_raw_bytes(tmp_path):
    bus = EmbeddedBus(tmp_path / "bus", partitions=2)
    text = Record("flywheel.samples", 1, 7, "c-1", b'{"not": "a sample"')
    binary = Record("flywheel.samples", 0, 3, "c-2", b"\xff\x00\xfe")
    a = dead_letter(bus, text, "invalid JSON: EOF", "learner.decode")
    b = dead_letter(bus, binary, "x" * 10_000, "learner.decode")
    got = {letter.key: letter for letter in read_all(bus)}
    assert got == {"c-1": a, "c-2": b}
    assert (a.topic, a.partition, a.offset, a.stage) == ("flywheel.samples", 1, 7, "learner.decode")
    assert a.encoding == "text" and a.value == '{"not": "a sample"' and a.raw() == text.value
    assert b.encoding == "base64" and b.raw() == b"\xff\x00\xfe" and len(b.reason) == 4000
    # The same record dead-lettered again by the same stage (a consumer that crashed before committing)
    # has the same id; another stage gives another.
    assert dead_letter(bus, text, "again", "learner.decode").event_id == a.event_id
    assert dead_letter(bus, text, "nan", "learner.quarantine").event_id != a.event_id
    bus.close()
