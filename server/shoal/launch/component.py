"""`shoal component ROLE`: run one component in this process, and turn its end into an exit code.

    the entry returns, or SIGTERM        0   completed
    StartupFailed, ConfigError           88  startup-failed
    PeerLost                             75  peer-lost
    any other exception                  1   crash
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Callable

import setproctitle

from shoal import faults
from shoal.config import ComponentArgs, ConfigError, ServerArgs
from shoal.launch.plan import METRICS_DIR_ENV
from shoal.lifecycle import ExitCode, PeerLost, StartupFailed, die_with_parent, exit_process, fail

logger = logging.getLogger(__name__)

ROLES = ("api", "detokenizer", "scheduler")


def _entry(role: str) -> Callable[[ServerArgs, ComponentArgs], None]:
    if role == "api":
        from shoal.api.process import run_api
        return run_api
    if role == "detokenizer":
        from shoal.detokenizer.process import run_detokenizer
        return run_detokenizer
    from shoal.scheduler.process import run_scheduler
    return run_scheduler


def run_component(role: str, args: ServerArgs, component: ComponentArgs) -> None:
    is_scheduler = role == "scheduler"
    name = component.scheduler_name(args) if is_scheduler else role
    rank = component.global_rank(args) if is_scheduler else None
    setproctitle.setproctitle(f"shoal::{name}")
    die_with_parent(name, rank)
    if METRICS_DIR_ENV in os.environ:
        os.makedirs(os.environ[METRICS_DIR_ENV], exist_ok=True)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s")
    try:
        crash_after = faults.crash_after(faults.faults_from_env(), name)
        if crash_after is not None:
            threading.Timer(crash_after, _injected_crash, (name, rank)).start()
        _entry(role)(args, component)
    except (StartupFailed, ConfigError) as exc:
        fail(ExitCode.STARTUP_FAILED, name, rank, str(exc))
    except PeerLost as exc:
        logger.error("lost a peer rank: %s", exc)
        fail(ExitCode.PEER_LOST, name, rank, f"a peer rank failed: {exc}")
    except SystemExit as exc:
        exit_process(exc.code if isinstance(exc.code, int) else int(exc.code is not None))
    except KeyboardInterrupt:
        exit_process(ExitCode.COMPLETED)
    except BaseException as exc:  # any uncaught error ends the component as a crash
        logger.error("%s crashed:\n%s", name, traceback.format_exc())
        fail(ExitCode.CRASH, name, rank, f"{type(exc).__name__}: {exc}")
    exit_process(ExitCode.COMPLETED)


def _injected_crash(name: str, rank: int | None) -> None:
    logger.error("%s crashed: injected by SHOAL_FAULT", name)
    fail(ExitCode.CRASH, name, rank, "RuntimeError: injected by SHOAL_FAULT")
