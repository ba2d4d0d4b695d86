"""The command line (Typer): parse → call one library function in verbs/ → render through render/ → exit code.

May import every layer below; nothing imports it. `entry` is the console script (logins start ahead, `ahead`,
before the app's imports); `app` registers the verbs of `lifecycle`, `operate`, `bench` and `lab`; `common` holds
what they share (one JSON document and exit code per run, the inventory and its SSH pool, Ctrl-C).
"""
