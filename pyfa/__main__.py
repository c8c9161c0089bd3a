"""`python -m pyfa`: the main job (pyfa/cli: info, check, bench, and with no
command a quick look at this machine)."""
from pyfa.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
