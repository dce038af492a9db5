"""``isocost agent``: the sidecar that registers one engine in etcd (DESIGN §7).

``engine`` reads what the agent needs from its engine over HTTP (readiness, served models,
engine kind and release, load, request outcomes); ``health`` judges the recent success
rate without flapping on one blip; ``registrar`` holds the lease, the record and the drain.
"""
