"""Opening the configured event bus: the one place that picks an implementation from the settings.

Imported by the entry points (the CLI's commands, the gateway); the bus modules never import it.
"""

from __future__ import annotations

from feedback.bus import EventBus


def open_bus(settings, role: str) -> EventBus:
    """The bus `settings` (`core.settings.Settings`) names: the embedded durable log, or Kafka
    (kafka-python imported only when asked for). On Kafka, each process keeps its own spool, by
    `role` (`<home>/spool/<role>`: the processes of `flywheel up` share a home, and a spool is one
    process's log); the same role after a restart finds what it had not yet sent."""
    if settings.bus == "kafka":
        from feedback.bus_kafka import KafkaBus

        if not role or "/" in role or role.startswith("."):
            raise ValueError(f"a bus role names a folder: non-empty, no '/', not hidden; got {role!r}")
        return KafkaBus(settings.kafka_bootstrap, spool_dir=settings.home / "spool" / role)
    from feedback.bus_embedded import EmbeddedBus

    return EmbeddedBus(settings.home / "bus")
