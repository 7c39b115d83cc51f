"""Message plumbing every consumer and producer shares: where a message came from, dead
letters, decoding request logs, and the partition a key goes to."""
