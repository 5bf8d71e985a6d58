"""Entry point of one scheduler rank: load the model, report ready, run the loop."""

from __future__ import annotations

import logging
import os
import signal

import torch

from shoal.config import ComponentArgs, ServerArgs
from shoal.engine.model_runner import ModelRunner, resolve_device, resolve_dtype
from shoal.engine.parallel import ParallelGroup
from shoal.ipc import sockets
from shoal.ipc.messages import ComponentReady
from shoal.models import ModelConfig
from shoal.scheduler.io import Rank0IO
from shoal.scheduler.memory import ReqMemory
from shoal.scheduler.scheduler import Scheduler, SchedulerLimits
from shoal.scheduler.stop import StopChecker
from shoal.tokenizer import load_tokenizer, resolve_model_path

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 256


def run_scheduler(args: ServerArgs, component: ComponentArgs) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks_per_node))
    model_path = resolve_model_path(args)
    device = resolve_device(args.device)
    config = ModelConfig.from_pretrained(model_path)
    limits = SchedulerLimits(
        context_length=args.context_length or config.max_position_embeddings,
        max_running_requests=args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
        chunked_prefill_size=args.chunked_prefill_size)
    runner = ModelRunner(
        model_path=model_path, device=device, dtype=resolve_dtype(args.dtype, device),
        tp=ParallelGroup(), pp_rank=component.pp_rank, pp_size=args.pp,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=limits.max_running_requests, context_length=limits.context_length)
    tokenizer = load_tokenizer(model_path)
    eos_ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    io = Rank0IO(sockets.Endpoints(component.run_dir))
    scheduler = Scheduler(
        runner=runner,
        memory=ReqMemory(runner.req_to_token_pool, runner.token_allocator),
        io=io, stop_checker=StopChecker(tokenizer, eos_ids, limits.context_length),
        limits=limits)

    def stop(signum: int, frame: object) -> None:
        scheduler.should_stop = True

    signal.signal(signal.SIGTERM, stop)
    io.send_ready(ComponentReady(component="scheduler", max_total_tokens=runner.max_total_tokens,
                                 max_running_requests=limits.max_running_requests,
                                 context_length=limits.context_length))
    logger.info("scheduler ready: %d KV slots, context %d, device %s",
                runner.max_total_tokens, limits.context_length, device)
    scheduler.run_forever()
