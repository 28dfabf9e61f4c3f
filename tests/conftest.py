"""Shared helpers for the unit tests."""
