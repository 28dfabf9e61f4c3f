"""Shared helpers for the unit tests."""

from hypothesis import HealthCheck, settings

# Generated inputs are checked for what they find, not for how fast a busy machine makes them:
# timing checks on shared CI cores fail tests that found nothing wrong.
settings.register_profile("vramguard", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("vramguard")
