"""Entry point of one scheduler rank: join the ranks, load the model, report ready, run the loop."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shoal import faults
from shoal.config import ComponentArgs, ServerArgs
from shoal.engine.distributed import RankGroups, RankLayout, init_distributed
from shoal.engine.model_runner import ModelRunner, resolve_device, resolve_dtype
from shoal.engine.parallel import ParallelGroup
from shoal.ipc import sockets
from shoal.ipc.messages import ComponentReady
from shoal.launch.component import StartupFailed, component_name
from shoal.lifecycle import ExitCode, fail
from shoal.metrics.scheduler_metrics import SchedulerStats
from shoal.models import ModelConfig
from shoal.models.linear_kernels import use_threads_for_large_products
from shoal.scheduler.consensus import ConsensusChecker
from shoal.scheduler.io import Rank0IO
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.ranks import (BroadcastingIO, FollowerIO, HangingRunner, PipelineStage,
                                   SharedSampling)
from shoal.scheduler.prefix_cache import NoPrefixCache, PrefixCache, RadixCache
from shoal.scheduler.scheduler import Scheduler, SchedulerConfig, local_sampling
from shoal.scheduler.stop import StopChecker
from shoal.scheduler.watchdog import Watchdog
from shoal.tokenizer import load_tokenizer, resolve_model_path

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 256


def torch_threads_per_rank(num_cores: int, ranks_on_this_host: int) -> int:
    """Cores per local rank, leaving one core to the api and detokenizer. OpenMP threads that
    outnumber the free cores stall at every barrier (a 20-70x slowdown measured on 2 cores)."""
    return max(1, (num_cores - 1) // ranks_on_this_host)


def large_product_threads_per_rank(num_cores: int, ranks_on_this_host: int) -> int:
    """Cores per local rank, none left over: for the prefill's large products only (they are
    one barrier each; see `shoal.models.linear_kernels`)."""
    return max(1, num_cores // ranks_on_this_host)


@dataclass(frozen=True)
class RankContext:
    name: str
    run_dir: str
    layout: RankLayout
    groups: RankGroups


def run_scheduler(args: ServerArgs, component: ComponentArgs) -> None:
    name = component_name("scheduler", args, component)
    layout = RankLayout(tp_rank=component.tp_rank, tp_size=args.tp, pp_rank=component.pp_rank,
                        pp_size=args.pp)
    injected = faults.faults_from_env()
    cores = os.cpu_count() or 1
    threads = torch_threads_per_rank(cores, args.ranks_per_node)
    torch.set_num_threads(threads)
    use_threads_for_large_products(threads,
                                   large_product_threads_per_rank(cores, args.ranks_per_node))
    try:
        device = resolve_device(args.device)
        if device.type == "cuda":  # one GPU per local rank
            device = torch.device("cuda", layout.rank % args.ranks_per_node)
        groups = init_distributed(layout, args.dist_init_addr, device,
                                  with_consensus_group=args.enable_rank_consensus_check)
        context = RankContext(name, component.run_dir, layout, groups)
        scheduler = _build_scheduler(args, context, device, injected)
    except (OSError, ValueError, RuntimeError) as exc:
        raise StartupFailed(f"{type(exc).__name__}: {exc}") from exc

    def stop(signum: int, frame: object) -> None:
        scheduler.should_stop = True

    signal.signal(signal.SIGTERM, stop)
    Watchdog(args.watchdog_timeout, lambda: (scheduler.has_work, scheduler.num_forward_steps),
             scheduler.describe_running, name, layout.rank).start()
    try:
        if args.use_overlap_schedule:
            logger.info("scheduling with the overlap loop")
            scheduler.run_forever_overlapped()
        else:
            scheduler.run_forever()
    except (dist.DistError, RuntimeError) as exc:
        if layout.world_size == 1 or not _is_peer_failure(exc):
            raise
        logger.error("lost a peer rank: %s", exc)
        fail(ExitCode.PEER_LOST, name, layout.rank, f"a peer rank failed: {exc}")


def _build_scheduler(args: ServerArgs, ctx: RankContext, device: torch.device,
                     injected: list[faults.Fault]) -> Scheduler:
    layout, groups = ctx.layout, ctx.groups
    model_path = resolve_model_path(args)
    config = ModelConfig.from_pretrained(model_path)
    sched_config = SchedulerConfig(
        context_length=args.context_length or config.max_position_embeddings,
        max_running_requests=args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_policy=args.schedule_policy)
    world = ParallelGroup(rank=layout.rank, size=layout.world_size, group=groups.control)
    runner = ModelRunner(
        model_path=model_path, device=device, dtype=resolve_dtype(args.dtype, device),
        tp=groups.tp, pp_rank=layout.pp_rank, pp_size=layout.pp_size,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=sched_config.max_running_requests,
        context_length=sched_config.context_length,
        world=world)
    tokenizer = load_tokenizer(model_path)
    eos_ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)

    forward_runner: ModelRunner | PipelineStage | HangingRunner = (
        PipelineStage(runner, layout) if layout.pp_size > 1 else runner)
    hang_after = faults.hang_forward_after(injected, layout.rank)
    if hang_after is not None:
        forward_runner = HangingRunner(forward_runner, hang_after)
    io = _make_io(layout, groups, sockets.Endpoints(ctx.run_dir))
    checker = None
    if groups.consensus is not None:
        checker = ConsensusChecker(groups.consensus, ctx.name, layout.rank,
                                   faults.diverge_consensus_after(injected, layout.rank))
        checker.start()
    cache: PrefixCache = (NoPrefixCache() if args.disable_radix_cache
                          else RadixCache(runner.token_allocator))
    scheduler = Scheduler(
        runner=forward_runner,
        memory=ReqMemory(runner.req_to_token_pool, runner.token_allocator, cache),
        io=io, stop_checker=StopChecker(tokenizer, eos_ids, sched_config.context_length),
        config=sched_config,
        sampling=local_sampling if groups.control is None else SharedSampling(layout,
                                                                              groups.control),
        record_event=checker.record if checker is not None else None,
        stats=SchedulerStats(args.enable_metrics) if layout.rank == 0 else None)
    io.send_ready(ComponentReady(component="scheduler", max_total_tokens=runner.max_total_tokens,
                                 max_running_requests=sched_config.max_running_requests,
                                 context_length=sched_config.context_length))
    logger.info("scheduler ready: %d KV slots, context %d, device %s",
                runner.max_total_tokens, sched_config.context_length, device)
    return scheduler


def _make_io(layout: RankLayout, groups: RankGroups,
             endpoints: sockets.Endpoints) -> Rank0IO | BroadcastingIO | FollowerIO:
    if groups.control is None:
        return Rank0IO(endpoints)
    if layout.rank == 0:
        return BroadcastingIO(Rank0IO(endpoints), groups.control)
    return FollowerIO(groups.control)


_PEER_FAILURE_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out",
                       "socket", "peer")


def _is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because another rank went away (gloo/NCCL report it this way)."""
    return isinstance(exc, dist.DistError) or any(
        hint in str(exc).lower() for hint in _PEER_FAILURE_HINTS)
