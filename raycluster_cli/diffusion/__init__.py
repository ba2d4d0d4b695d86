"""Image generation's node side: a diffusers checkpoint's parts, the UNet cut, their placement and workers, the image router; imports models, placement and node."""
