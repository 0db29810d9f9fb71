"""Streams: named logs over ledgers, with cursors (Pulsar's managed ledgers)."""
