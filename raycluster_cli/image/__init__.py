"""Getting the node image onto the hosts: the plan and delivery (`deliver`), the archive saved and compressed once
(`archive`), who sends to whom (`schedule`) and the host-to-host copy (`peer_copy`).

May import host/, transport/, config/ and the root modules.
"""
