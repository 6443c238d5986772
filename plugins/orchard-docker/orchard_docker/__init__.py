"""Orchard's Docker Engine backend (``docker``): a container per sandbox, its agent inside."""
