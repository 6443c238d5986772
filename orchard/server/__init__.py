"""``orchard serve``: the Orchard Env REST service (state, reconciler, auth, metrics)."""
