"""Integrations with training frameworks (Ray Train v2)."""
