"""Node side: the OpenAI-compatible service that runs inside the node image (imports ray, torch, transformers, fastapi; may import bench's node-side modules)."""
