"""Model families: configs, the decoders' units, checkpoint loading, the batched forward and its matmul forms; imports only the package root."""
