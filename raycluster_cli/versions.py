"""What the CLI expects inside the node image: one place, used by `doctor` and the image build."""

RAY_VERSION = "2.60.0"
PYTHON_VERSION = "3.11"  # major.minor: Ray needs the same one on every node and in the driver
