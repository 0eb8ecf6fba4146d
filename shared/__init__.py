"""What the daemon, its workers and its clients share: protocol, codec, config, client."""

__version__ = "0.1.0"
