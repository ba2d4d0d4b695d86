"""`python -m raycluster_cli`: the `raycluster` command (logins started ahead, see prelogin.py)."""

from .prelogin import main

if __name__ == "__main__":
    main()
