"""The ``orchard`` command line."""
