"""Message schemas, topic conventions and (de)serialization of sandstream's Kafka log."""
