"""The local multi-host lab: Docker-in-Docker hosts with sshd and an engine each (`hosts`), Docker or Podman
(`engines`).

May import host/ (image IDs), transport/, config/ and the root modules.
"""
