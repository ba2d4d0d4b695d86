"""The service (``serve``): the OpenAI-compatible ingresses, the pool of pipelines, the engine and its stages.

Runs inside the node image (the operator side imports only ``metrics``' names and ``options``, pure pydantic);
builds on models/, placement/, node/ and diffusion/, and never imports bench/.
"""
