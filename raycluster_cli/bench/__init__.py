"""Sharded-model (pipeline-parallel) inference benchmark that runs inside a Ray cluster.

``metrics`` and ``partition`` are pure Python so the operator CLI can import them without torch;
``model``, ``pipeline`` and ``driver`` need torch (and Ray) and are imported only where they run.
"""
