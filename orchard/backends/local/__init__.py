"""The built-in local backend: sandboxes on this machine, served by one local agent.

Import :mod:`orchard.backends.local.backend` for the classes; this package imports
nothing itself, so an agent (which loads the built-in plugins for their runtimes)
never pulls in the backend's client dependencies.
"""
