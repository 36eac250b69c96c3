"""kvserve on Ray Serve: one engine per replica behind an ingress that routes by the
KV blocks each replica holds (its KV events) or, failing that, by prompt prefix.
Imports of `ray` stay inside the modules that need it, so `kvserve serve` without `--replicas`
never imports Ray (install it with the `ray` extra: `pip install 'kvserve[ray]'`)."""
