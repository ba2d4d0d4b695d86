"""Getting content onto the hosts with one relay (`relay`, who sends to whom: `schedule`, host to host: `peer_copy`,
the receiving host's verify-then-use script: `receive`) for the node image (`deliver`, the archive saved and
compressed once: `archive`) and for models (`models`, `model_relay`).

May import host/, transport/, config/ and the root modules.
"""
