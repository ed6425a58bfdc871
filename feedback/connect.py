"""Opening the configured event bus: the one place that picks an implementation from the settings.

Imported by the entry points (the CLI's commands, the gateway); the bus modules never import it.
"""

from __future__ import annotations

from feedback.bus import EventBus


def open_bus(settings) -> EventBus:
    """The bus `settings` (`core.settings.Settings`) names: the embedded durable log, or Kafka
    (kafka-python imported only when asked for)."""
    if settings.bus == "kafka":
        from feedback.bus_kafka import KafkaBus

        return KafkaBus(settings.kafka_bootstrap, spool_dir=settings.home / "spool")
    from feedback.bus_embedded import EmbeddedBus

    return EmbeddedBus(settings.home / "bus")
