"""`shoal component NAME`: run one component in this process, and turn its end into an exit code."""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Callable

import setproctitle

from shoal import faults
from shoal.config import ComponentArgs, ConfigError, ServerArgs
from shoal.launch.plan import METRICS_DIR_ENV, scheduler_name
from shoal.lifecycle import ExitCode, die_with_parent, exit_process, fail

logger = logging.getLogger(__name__)

ROLES = ("api", "detokenizer", "scheduler")


class StartupFailed(RuntimeError):
    """The component cannot start (bad config, model that cannot load): do not hot-restart."""


def _entry(role: str) -> Callable[[ServerArgs, ComponentArgs], None]:
    if role == "api":
        from shoal.api.http_server import run_api
        return run_api
    if role == "detokenizer":
        from shoal.detokenizer.process import run_detokenizer
        return run_detokenizer
    from shoal.scheduler.process import run_scheduler
    return run_scheduler


def component_name(role: str, args: ServerArgs, component: ComponentArgs) -> str:
    if role == "scheduler":
        return scheduler_name(component.pp_rank, component.tp_rank, args.pp)
    return role


def run_component(role: str, args: ServerArgs, component: ComponentArgs) -> None:
    name = component_name(role, args, component)
    rank = component.pp_rank * args.tp + component.tp_rank if role == "scheduler" else None
    setproctitle.setproctitle(f"shoal::{name}")
    die_with_parent()
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
    except SystemExit as exc:
        exit_process(exc.code if isinstance(exc.code, int) else int(exc.code is not None))
    except KeyboardInterrupt:
        exit_process(ExitCode.COMPLETED)
    except BaseException as exc:  # noqa: BLE001 - any uncaught error ends the component as a crash
        logger.error("%s crashed:\n%s", name, traceback.format_exc())
        fail(ExitCode.CRASH, name, rank, f"{type(exc).__name__}: {exc}")
    exit_process(ExitCode.COMPLETED)


def _injected_crash(name: str, rank: int | None) -> None:
    logger.error("%s crashed: injected by SHOAL_FAULT", name)
    fail(ExitCode.CRASH, name, rank, "RuntimeError: injected by SHOAL_FAULT")
