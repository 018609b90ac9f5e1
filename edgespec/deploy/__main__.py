"""`python -m edgespec.deploy`: find or build llama.cpp's llama-server and rpc-server (cached), print their folder."""
from __future__ import annotations

from .build import main

raise SystemExit(main())
