"""Sandbox backends: where sandboxes live. ``local`` is built in; others are plugins."""
