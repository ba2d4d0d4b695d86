"""`python -m raycluster_cli`: the `raycluster` command (logins started ahead, see cli/entry.py)."""

from raycluster_cli.cli.entry import main

if __name__ == "__main__":
    main()
