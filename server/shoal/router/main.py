"""The router process: `shoal router ...`, process title `shoal::router`."""

from __future__ import annotations

import logging

import setproctitle
import uvicorn

from shoal.router.app import create_app
from shoal.router.args import RouterArgs


def run_router(args: RouterArgs) -> None:
    setproctitle.setproctitle("shoal::router")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [router] %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(args), host=args.host, port=args.port,
                log_level=args.log_level.lower(), access_log=args.log_level.lower() == "debug",
                timeout_keep_alive=5)
