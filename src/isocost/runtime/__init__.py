"""The brain's host, shared by every data plane and by the simulator (DESIGN §2).

It sits below ``gateway``, ``agent`` and ``sim`` and above ``scheduling``: what they must
read or do the same way lives here once, so that none imports another: the gateway's YAML
configuration (``runtime.config``), which ``isocost serve`` runs and ``isocost sim
--config`` simulates as is; the reading of an engine's ``/metrics`` (``runtime.scrape``),
which the gateway and ``isocost agent`` share; the etcd client (``runtime.etcd``) and the
discovery providers (``runtime.discovery``) that any data plane can follow.
"""
