"""Reading a gateway's or EPP's ``/debug/decisions`` once its requests have ended."""

from __future__ import annotations

import time

import httpx


def settled_decisions(url: str, key: str, n: int = 20, timeout: float = 10.0) -> list[dict]:
    """The latest ``n`` decisions at ``url`` (read with the admin ``key``), once none is
    pending, or as they are after ``timeout`` s. Behind Envoy a non-streamed request's end
    reaches the EPP with Envoy's access log entry, sent in batches every 10 ms, so the
    caller may have its answer a moment before the decision shows how it ended."""
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(f"{url}/debug/decisions?n={n}",
                             headers={"authorization": f"Bearer {key}"}, timeout=10)
        response.raise_for_status()
        found = response.json()["decisions"]
        if all(d["outcome"] != "pending" for d in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)
