"""Carrying container images and model folders to hosts (archives, relays, peer copies, holdings); operator side, below verbs."""
