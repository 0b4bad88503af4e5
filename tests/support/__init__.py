"""Helpers the test folders share (imported as `support.<module>`: pytest puts tests/ on the path)."""
