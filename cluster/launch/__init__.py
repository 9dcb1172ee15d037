"""The launch layer: `pdserve serve` and `status`, the Serve application's assembly (the
only place that imports a tier), and a local cluster's Redis, HAProxy settings, ports and
the lifetime of what it starts."""
