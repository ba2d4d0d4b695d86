"""What a host is and what runs on it: facts (a command plus a pure parser, cached per host), the engine's dialects,
the Ray container's command line, the cluster's folders on the host, one node's start and wait, why a node did not
join, and `probe` (the one module here that runs inside the node's container: it imports ray).

May import transport/, config/ and the root modules.
"""
