"""Faust plumbing every Kafka-reading command shares: the app on the configured broker, its
transports per broker kind, guards against lost records after a seek, a watchdog for stuck
partitions, and table writes that wait for the broker."""
