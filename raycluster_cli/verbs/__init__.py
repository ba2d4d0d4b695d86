"""One library function per verb (up and its phases, down, status, logs, execute, jobs, metrics, bench's operator
side); each takes the inventory and a `Connect`, reports through a progress callback and never prints.

May import image/, checks/, host/, transport/, config/, the package's root modules and the bench/ and serve/ modules
that need no Ray (placement.balance, bench.options, serve.metrics); never cli/ or render/.
"""
