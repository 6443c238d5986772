"""The backend conformance kit: a pytest plugin and the suite every backend must pass.

Run it against any installed backend::

    pytest --pyargs orchard.testing.conformance --orchard-backend NAME [--orchard-backend-config FILE]
"""
