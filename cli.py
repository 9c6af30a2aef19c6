#!/usr/bin/env python
"""raytrain-lm: pretrain GPT-style language models with Ray Train.

The entry point users run (`python cli.py COMMAND`), the same app as the `raytrain-lm` command.
The commands live in raytrain_lm/cli/.
"""

from raytrain_lm.cli import app, main

__all__ = ["app", "main"]  # app: for tests that add a command

if __name__ == "__main__":
    main()
