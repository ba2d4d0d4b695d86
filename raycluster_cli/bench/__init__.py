"""The benchmark's node side: sharded-model (pipeline-parallel) inference that runs inside the node image.

May import only the root modules (errors, schema); the operator side of `bench` is verbs/bench.py.

``metrics`` and ``partition`` are pure Python so the operator CLI can import them without torch;
``model``, ``pipeline`` and ``driver`` need torch (and Ray) and are imported only where they run.
"""
