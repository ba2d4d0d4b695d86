"""The benchmark (``bench``) on the cluster: its options, the driver, the counted run and its references.

Runs inside the node image (the operator side imports only ``options``); builds on models/, placement/, node/ and
diffusion/, and never imports serve/.
"""
