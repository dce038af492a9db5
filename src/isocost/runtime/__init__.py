"""The brain's host, shared by every data plane and by the simulator (DESIGN §2).

It sits below ``gateway`` and ``sim`` and above ``scheduling``: what both must read or do
the same way lives here once, so that neither imports the other. Today that is the
gateway's YAML configuration (``runtime.config``), which ``isocost serve`` runs and
``isocost sim --config`` simulates as is.
"""
