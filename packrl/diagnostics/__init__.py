"""Metrics, stage timers and run logs."""
