"""onnxruntime's process-wide thread pool (runtimes/onnxruntime/pool.py), on a tiny model.

The pool is made once per process and never goes, so every check runs in a fresh interpreter:
the library alone leaves onnxruntime's pools as they are; after `share_threads()` the sessions
edgespec builds run on one pool whatever thread count they ask, compute the same logits bit for
bit as sessions with pools of their own, and speculative greedy there is plain greedy; the
`edgespec` command asks for the pool, `main` called as a function does not."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("onnxruntime")

from tests.test_onnxruntime_split import files  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402

_SHARED = textwrap.dedent("""
    import json, sys
    import numpy as np
    import onnxruntime as ort
    import edgespec
    from edgespec.runtimes.onnxruntime.pool import pool_state
    from edgespec.runtimes.onnxruntime.split import open_shared_pair

    bundle, target, draft = sys.argv[1:4]
    ids = [(7 * i) % 50 + 3 for i in range(40)]

    def logits(pair):
        t, d = pair
        t.reset()
        d.reset()
        return np.array(t.forward(ids, n_logits=5)), np.array(d.forward(ids + [9], n_logits=2))

    own = open_shared_pair(target, draft, threads=2, pad_rows=True)  # before: pools of their own
    before = pool_state()
    edgespec.share_threads()
    on_pool = open_shared_pair(target, draft, threads=2, pad_rows=True)
    made = pool_state()
    other = open_shared_pair(target, draft, threads=1, pad_rows=True)  # another count: the pool still
    same = [bool(np.array_equal(a, b)) for pair in (on_pool, other) for a, b in zip(logits(own), logits(pair))]
    own[0].forward([5])  # a session made before the pool still runs
    try:
        ort.InferenceSession(target, providers=["CPUExecutionProvider"])
        refused = ""
    except Exception as e:
        refused = str(e)
    with edgespec.load(bundle, backend="onnxruntime", draft_body="shared", threads=2) as spec, \\
            edgespec.load(bundle, backend="onnxruntime", use_draft=False, threads=2) as plain:
        texts = [e.generate("the cat sat on", max_tokens=24) for e in (spec, plain)]
    print(json.dumps({"before": before, "made": made, "same": same, "refused": refused, "texts": texts}))
""")

_LIBRARY = textwrap.dedent("""
    import json, sys
    import onnxruntime as ort
    import edgespec
    from edgespec.runtimes.onnxruntime.pool import pool_state

    with edgespec.load(sys.argv[1], backend="onnxruntime", draft_body="shared", threads=2) as e:
        text = e.generate("the cat", max_tokens=8)
    ort.InferenceSession(sys.argv[2], providers=["CPUExecutionProvider"])  # the application's own session
    print(json.dumps({"state": pool_state(), "text": text}))
""")

_COMMAND = textwrap.dedent("""
    import io, json, sys
    from contextlib import redirect_stdout
    from edgespec.cli import main, run
    from edgespec.runtimes.onnxruntime.pool import pool_state

    with redirect_stdout(io.StringIO()):
        main(["--version"])
        as_function = pool_state()
        sys.argv = ["edgespec", "--version"]
        run()
    print(json.dumps({"function": as_function, "command": pool_state()}))
""")


def run_json(code: str, *args, timeout: float = 600) -> dict:
    """Run `code` in a fresh interpreter (a process-wide pool cannot be undone) and return the JSON
    its last line prints."""
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sessions_on_the_shared_pool_compute_the_same_bits(zoo):
    bundle = zoo.bundle("gemma3-tied", DISAGREEING)
    target, draft = files(bundle)
    got = run_json(_SHARED, bundle, target, draft)
    assert got["before"] == {"allowed": False, "made": None}
    assert got["made"] == {"allowed": True, "made": 2}  # made by the first session, with its count
    assert got["same"] == [True] * 4  # target and draft logits, on the pool at 2 and at 1 thread asked
    # onnxruntime's own rule once the pool exists, which is why only a process owner asks for it
    assert "use_per_session_threads" in got["refused"]
    assert got["texts"][0] == got["texts"][1] != ""  # speculative greedy == plain greedy on the pool


def test_the_library_alone_leaves_onnxruntime_pools_be(zoo):
    bundle = zoo.bundle("gemma3-tied", DISAGREEING)
    got = run_json(_LIBRARY, bundle, files(bundle)[0])
    assert got["state"] == {"allowed": False, "made": None} and got["text"] != ""


def test_the_command_asks_for_the_pool_and_main_does_not():
    got = run_json(_COMMAND)
    assert got["function"]["allowed"] is False
    assert got["command"]["allowed"] is True and got["command"]["made"] is None  # made by a first session only
