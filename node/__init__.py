"""A storage node for append-only data, in the family of Apache BookKeeper's bookie."""

__version__ = "0.1.0"
