"""The runner of the proxy's client scripts (`test_proxy_*.py`): each check in order, one line
each (`ok   NAME` or `FAIL NAME: ERROR`), then "N passed, M failed"; the Rust tests that start
the servers read those lines (`Gateway::run_checks`)."""

import os
import sys


def run(tests, client=None):
    """Runs `tests` (functions that raise on failure) and exits: 0 when all passed, 1 when any
    failed, 2 when not started by the Rust test (no `SPENDGATE_BASE_URL`). `client`: the
    client library's module, whose version is printed first."""
    if not os.environ.get("SPENDGATE_BASE_URL"):
        sys.stderr.write("SPENDGATE_BASE_URL is not set: run through the Rust test\n")
        sys.exit(2)
    if client is not None:
        print(client.__name__, client.__version__)
    failed = 0
    for t in tests:
        try:
            t()
            print(f"ok   {t.__name__}")
        except Exception as e:  # noqa: BLE001 - report every failure, then exit non-zero
            failed += 1
            print(f"FAIL {t.__name__}: {type(e).__name__}: {e!r}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
