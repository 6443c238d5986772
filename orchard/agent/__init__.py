"""The exec agent: the only code that runs commands in sandboxes."""
