"""Falcon resources; each receives the ``ServerContext`` it needs."""
