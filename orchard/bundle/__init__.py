"""The relocatable agent bundle: the exec agent with its own Python and libc, for images
that have neither (see :mod:`orchard.bundle.build`)."""
