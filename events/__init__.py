"""Message schemas, topic conventions and (de)serialization of sandstream's Kafka log; and the
back-off its clients retry with (``backoff``), which the layers above share."""
