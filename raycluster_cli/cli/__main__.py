"""`python -m raycluster_cli.cli`: the CLI without the logins started ahead."""

from raycluster_cli.cli.app import main

main()
