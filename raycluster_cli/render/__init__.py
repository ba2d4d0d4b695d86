"""What the user sees: tables, live views, charts and the JSON documents; the only modules that import rich.

May import verbs/ (for their result and event types), transport.stream, progress, schema; never the hosts.
"""
