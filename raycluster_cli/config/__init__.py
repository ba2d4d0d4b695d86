"""What the operator's files say: the inventory (strict YAML → frozen pydantic model), the references it names
(image, hostname, login), paths, the CLI's defaults, and this machine's state for a cluster (token, lock).

May import only the root modules (errors, progress, cancel).
"""
