"""Container HEALTHCHECK: exit 0 when the server's `/health` answers 200, else 1.

The address is the server's own (`SHOAL_HOST`/`SHOAL_PORT`, as the entrypoint reads them); a
wildcard host is checked on loopback. Standard library only, so it stays cheap to run.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def health_url(environ: dict[str, str]) -> str:
    host = environ.get("SHOAL_HOST", "127.0.0.1")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{environ.get('SHOAL_PORT', '30000')}/health"


def main() -> int:
    url = health_url(dict(os.environ))
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            healthy = response.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    print(f"{'healthy' if healthy else 'unhealthy'}: {url}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
