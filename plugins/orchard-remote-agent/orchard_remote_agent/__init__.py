"""A worked example of a third-party Orchard backend plugin."""
