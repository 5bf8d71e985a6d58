"""Entry point of one scheduler rank: join the ranks, load the model, report ready, run the loop.

`build_scheduler` is the composition root: it picks this rank's IO, forward and sampling once
(`scheduler/io.py`, `engine/pipeline.py`, `scheduler/sampling.py`), so the loop itself has no
`if rank == 0`.
"""

from __future__ import annotations

import logging
import signal
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from shoal import faults
from shoal.config import ComponentArgs, ServerArgs
from shoal.cpu_cores import usable_cores
from shoal.disaggregation.decode import DecodeTransfer
from shoal.disaggregation.kv_map import rank_slice
from shoal.disaggregation.layout import advertised_host, layout_of, server_layout
from shoal.disaggregation.prefill import PrefillTransfer
from shoal.disaggregation.ranks import gather_endpoints
from shoal.disaggregation.rooms import TransferCounters
from shoal.disaggregation.transport import Transport
from shoal.engine.distributed import RankGroups, RankLayout, init_distributed
from shoal.engine.embedding_runner import EmbeddingRunner
from shoal.engine.model_runner import ModelRunner, resolve_device, resolve_dtype
from shoal.engine.pipeline import PipelineStage
from shoal.engine.threads import RankThreads
from shoal.ipc import sockets
from shoal.ipc.messages import ComponentReady
from shoal.lifecycle import StartupFailed
from shoal.metrics.scheduler_metrics import SchedulerStats
from shoal.model_config import ModelConfig, is_encoder_model
from shoal.models.parallel import ParallelGroup
from shoal.ports import free_port
from shoal.scheduler.consensus import ConsensusChecker
from shoal.scheduler.decode_role import DecodeRole
from shoal.scheduler.embedding import EmbeddingScheduler
from shoal.scheduler.grammar import Grammars
from shoal.scheduler.io import BroadcastingIO, FollowerIO, Rank0IO
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.prefill_role import PrefillRole
from shoal.scheduler.prefix_cache import NoPrefixCache, PrefixCache, RadixCache
from shoal.scheduler.roles import ColocatedRole, Role
from shoal.scheduler.sampling import SharedSampling, local_sampling
from shoal.scheduler.scheduler import Runner, Scheduler, SchedulerConfig, SchedulerIO
from shoal.scheduler.speculation import NgramProposer
from shoal.scheduler.stop import StopChecker
from shoal.scheduler.watchdog import Watchdog
from shoal.tokenizer import load_tokenizer, resolve_model_path, served_model_name

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 256
# Prompt tokens per scheduler step when --chunked-prefill-size is not given: a step stalls every
# running request's next token, and on CPU a step four times as long brings no more prompt
# tokens a second (docs/perf-log.md, "Session 8").
DEFAULT_CHUNKED_PREFILL_SIZE = {"cpu": 512, "cuda": 2048}


def chunked_prefill_size(args: ServerArgs, device: torch.device) -> int:
    return args.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL_SIZE[device.type]


@dataclass(frozen=True)
class RankContext:
    name: str
    run_dir: str
    layout: RankLayout
    groups: RankGroups
    device: torch.device
    threads: RankThreads


def run_scheduler(args: ServerArgs, component: ComponentArgs) -> None:
    """Serve until SIGTERM. A failed collective raises `PeerLost` out of the loop (exit 75)."""
    layout = RankLayout(tp_rank=component.tp_rank, tp_size=args.tp, pp_rank=component.pp_rank,
                        pp_size=args.pp)
    try:
        device = resolve_device(args.device)
        if device.type == "cuda":  # one GPU per local rank
            device = torch.device("cuda", layout.rank % args.ranks_per_node)
        encoder = is_encoder_model(resolve_model_path(args))
        overlap = not encoder and args.use_overlap_schedule(device.type)
        # an embedding rank leaves a core to the api, which works on every one of its requests
        threads = RankThreads.for_host(usable_cores(), args.ranks_per_node,
                                       spare_core=overlap or encoder)
        torch.set_num_threads(threads.base)
        groups = init_distributed(layout, args.dist_init_addr, device,
                                  with_consensus_group=args.enable_rank_consensus_check)
        context = RankContext(component.scheduler_name(args), component.run_dir, layout, groups,
                              device, threads)
        scheduler: Scheduler | EmbeddingScheduler = (
            build_embedding_scheduler(args, context) if encoder
            else build_scheduler(args, context, faults.faults_from_env()))
    except (OSError, ValueError, RuntimeError) as exc:
        raise StartupFailed(f"{type(exc).__name__}: {exc}") from exc

    def stop(signum: int, frame: object) -> None:
        scheduler.should_stop = True

    signal.signal(signal.SIGTERM, stop)
    Watchdog(args.watchdog_timeout, lambda: (scheduler.has_work, scheduler.num_forward_steps),
             scheduler.describe_running, context.name, layout.rank).start()
    if overlap and isinstance(scheduler, Scheduler):
        logger.info("scheduling with the overlap loop")
        scheduler.run_forever_overlapped()
    else:
        scheduler.run_forever()


def build_scheduler(args: ServerArgs, ctx: RankContext,
                    injected: list[faults.Fault]) -> Scheduler:
    layout, groups = ctx.layout, ctx.groups
    model_path = resolve_model_path(args)
    config = ModelConfig.from_pretrained(model_path)
    sched_config = SchedulerConfig(
        context_length=args.context_length or config.max_position_embeddings,
        max_running_requests=args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
        chunked_prefill_size=chunked_prefill_size(args, ctx.device),
        schedule_policy=args.schedule_policy,
        speculation=(NgramProposer(args.speculative_num_draft_tokens)
                     if args.speculation == "ngram" else None))
    runner = ModelRunner(
        model_path=model_path, device=ctx.device, dtype=resolve_dtype(args.dtype, ctx.device),
        tp=groups.tp, pp_rank=layout.pp_rank, pp_size=layout.pp_size,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=sched_config.max_running_requests,
        context_length=sched_config.context_length,
        world=ParallelGroup(rank=layout.rank, size=layout.world_size, group=groups.control),
        threads=ctx.threads, quantization=args.quantization, cpu_kernels=args.cpu_kernels)
    tokenizer = load_tokenizer(model_path)
    eos_ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    io = _make_io(layout, groups, sockets.Endpoints(ctx.run_dir))
    checker = None
    if groups.consensus is not None:
        checker = ConsensusChecker(groups.consensus, ctx.name, layout.rank,
                                   faults.diverge_consensus_after(injected, layout.rank))
        checker.start()
    cache: PrefixCache = (NoPrefixCache() if args.disable_radix_cache
                          else RadixCache(runner.token_allocator))
    memory = ReqMemory(runner.req_to_token_pool, runner.token_allocator, cache)
    stop_checker = StopChecker(tokenizer, eos_ids, sched_config.context_length)
    record_event = checker.record if checker is not None else None
    scheduler = Scheduler(
        runner=_make_forward(runner, layout, injected), memory=memory, io=io,
        stop_checker=stop_checker, config=sched_config,
        sampling=(local_sampling if groups.control is None
                  else SharedSampling(layout, groups.control)),
        record_event=record_event,
        stats=SchedulerStats(args.enable_metrics) if layout.rank == 0 else None,
        role=_make_role(args, ctx, runner, memory, stop_checker,
                        sched_config.max_running_requests, record_event),
        grammars=Grammars.for_tokenizer(tokenizer, config.vocab_size, eos_ids))
    io.send_ready(ComponentReady(component="scheduler", max_total_tokens=runner.max_total_tokens,
                                 max_running_requests=sched_config.max_running_requests,
                                 context_length=sched_config.context_length))
    logger.info("scheduler ready: %d KV slots, context %d, device %s",
                runner.max_total_tokens, sched_config.context_length, ctx.device)
    return scheduler


def build_embedding_scheduler(args: ServerArgs, ctx: RankContext) -> EmbeddingScheduler:
    """An embedding model's scheduler: one rank, no KV pool, no sampling."""
    if ctx.layout.world_size > 1 or args.disaggregation_mode != "null":
        raise ValueError("an embedding model is served by one rank, colocated: use --tp 1 --pp 1 "
                         "--nnodes 1 --disaggregation-mode null")
    runner = EmbeddingRunner(resolve_model_path(args), ctx.device,
                             resolve_dtype(args.dtype, ctx.device))
    io = Rank0IO(sockets.Endpoints(ctx.run_dir))
    max_inputs = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
    scheduler = EmbeddingScheduler(runner, io,
                                   max_batch_tokens=chunked_prefill_size(args, ctx.device),
                                   max_batch_inputs=max_inputs)
    io.send_ready(ComponentReady(component="scheduler", max_running_requests=max_inputs,
                                 context_length=runner.max_input_tokens,
                                 embedding_dimensions=runner.dimensions))
    logger.info("embedding scheduler ready: %d dimensions, inputs up to %d tokens, device %s",
                runner.dimensions, runner.max_input_tokens, ctx.device)
    return scheduler


def _make_role(args: ServerArgs, ctx: RankContext, runner: ModelRunner, memory: ReqMemory,
               stop_checker: StopChecker, max_running_requests: int,
               record_event: Callable[[str], None] | None) -> Role:
    """This server's disaggregation role; a PD rank binds its transfer inbox (a free port on
    `--host`), and a prefill's rank 0 also the bootstrap port, before it reports ready."""
    mode = args.disaggregation_mode
    if mode == "null":
        return ColocatedRole()
    layout = ctx.layout
    ranks = ParallelGroup(rank=layout.rank, size=layout.world_size, group=ctx.groups.control)
    local = server_layout(served_model_name(args), runner.model_config,
                          str(runner.dtype).removeprefix("torch."), args.tp, args.pp)
    counters = TransferCounters(export=args.enable_metrics)
    host, port = advertised_host(args.host), free_port(args.host)
    inbox = f"tcp://{host}:{port}"
    server = (f"tcp://{args.host}:{args.disaggregation_bootstrap_port}"
              if mode == "prefill" and layout.rank == 0 else None)
    try:
        transport = Transport(f"tcp://{args.host}:{port}", server, inbox)
    except zmq.ZMQError as exc:
        raise StartupFailed(f"cannot listen for KV transfers on {args.host} (bootstrap port "
                            f"{args.disaggregation_bootstrap_port}, inbox {port}): {exc}") from exc
    if mode == "prefill":
        session = uuid.uuid4().hex
        endpoints = gather_endpoints(inbox, ranks)
        prefill = PrefillTransfer(
            transport, layout.rank, rank_slice(local, layout.rank),
            layout.rank == layout.sampler_rank,
            layout_of(local, session, endpoints) if server else None,
            args.disaggregation_timeout, counters)
        transport.start(prefill)
        logger.info("prefill role: KV inbox %s%s", inbox,
                    f", bootstrap server on port {args.disaggregation_bootstrap_port}"
                    if server else "")
        return PrefillRole(prefill, runner.kv_pool, memory, ranks, record_event)
    decode = DecodeTransfer(transport, layout.rank, uuid.uuid4().hex, local, runner.kv_pool,
                            args.disaggregation_timeout, counters)
    transport.start(decode)
    logger.info("decode role: KV inbox %s", inbox)
    return DecodeRole(decode, memory, stop_checker, max_running_requests, ranks, record_event)


def _make_forward(runner: ModelRunner, layout: RankLayout,
                  injected: list[faults.Fault]) -> Runner:
    forward: Runner = PipelineStage(runner, layout) if layout.pp_size > 1 else runner
    hang_after = faults.hang_forward_after(injected, layout.rank)
    return forward if hang_after is None else faults.HangingRunner(forward, hang_after)


def _make_io(layout: RankLayout, groups: RankGroups,
             endpoints: sockets.Endpoints) -> SchedulerIO:
    if groups.control is None:
        return Rank0IO(endpoints)
    if layout.rank == 0:
        return BroadcastingIO(Rank0IO(endpoints), groups.control)
    return FollowerIO(groups.control)
