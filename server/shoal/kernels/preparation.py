"""`prepare`: the one entry that chooses a model's CPU kernels, from its declaration
(`shoal.kernels.interface`) and the server's settings (`--cpu-kernels`, device, dtype, tensor
parallelism, quantization, threads).

With `--cpu-kernels torch` every part of the model runs plain torch: `F.linear` on the weights
as loaded (int8 ones dequantized into it), torch's norms and rotary embedding, decode steps op by
op, SDPA over the gathered K/V, the full LM head. With `auto`, each kernel is taken where the
settings allow it, it runs on this host and agrees with torch on a small case (checked once per
process, first in a forked child: `shoal.kernels.kernel_probe`), and the model declares what it
computes; every choice is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.kernels import decode_attention, fused_decode, greedy_head, layer_kernels
from shoal.kernels.fused_decode import FusedDecode
from shoal.kernels.greedy_head import GreedyHead
from shoal.kernels.interface import DecodeLayer, KernelArgs, KernelModel
from shoal.kernels.linear_kernels import prepare_linears

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedKernels:
    """What `prepare` chose beyond the model itself: whether decode rows attend in place in
    the KV pool (`shoal.kernels.decode_attention`), for the attention backend."""

    in_place_decode: bool


def prepare(model: KernelModel, args: KernelArgs) -> PreparedKernels:
    """Choose and set up the kernels of a loaded model (one rank's, one pipeline stage's): its
    linear layers' stored weights and products, its layer ops, its fused decode and greedy LM
    head (set on the model); returns the attention backend's part."""
    spec = model.kernel_spec()
    quantized = args.quantization != "none"
    if args.mode == "torch":
        prepare_linears(spec.linears, args.quantization, torch_only=True)
        for ops in spec.layer_ops:
            ops.cpu_kernels = False
        model.fused_decode = model.greedy_head = None
        logger.info("--cpu-kernels torch: plain torch everywhere")
        return PreparedKernels(in_place_decode=False)
    fused = fused_decode.enabled_for(args.device, args.dtype, args.tp_size, quantized)
    prepare_linears(spec.linears, args.quantization, args.threads)
    layer_kernels.prepare(spec.layer_ops, args.device, args.dtype)
    if fused:
        model.fused_decode = _fused_decode(spec.decode_layers)
    if spec.lm_head is not None and greedy_head.enabled_for(args.device, args.dtype,
                                                            args.tp_size, quantized):
        head = GreedyHead.of(spec.lm_head.weight[:spec.vocab_size])
        logger.info("greedy steps' LM head screened by an int8 copy: %.0f MiB",
                    head.nbytes / 2**20)
        model.greedy_head = head
    return PreparedKernels(in_place_decode=_in_place_decode(args, spec.decode_layers))


def _in_place_decode(args: KernelArgs, layers: Sequence[DecodeLayer] | None) -> bool:
    """Whether decode rows attend in place in the KV pool: CPU float32 pools, every declared
    layer's attention what the kernel computes, and the kernel runs here (logged either way)."""
    if args.device.type != "cpu" or args.dtype != torch.float32:
        why = "not CPU float32"
    elif layers is None:
        why = "the model declares no decoder layers"
    else:
        missing = sorted({what for layer in layers
                          for what in decode_attention.not_taken(layer.attention)})
        why = ", ".join(missing) if missing else (
            "" if decode_attention.usable() else "the kernel does not run here")
    if why:
        logger.info("decode attention through SDPA over the gathered K/V: %s", why)
        return False
    logger.info("decode attention in place in the KV pool")
    return True


def _fused_decode(layers: Sequence[DecodeLayer] | None) -> FusedDecode | None:
    """The fused decode over the declared layers, or None (logged) where it does not take them."""
    if layers is None:
        logger.info("decode runs op by op: the model declares no decoder layers")
        return None
    try:
        fused = FusedDecode.of(layers)
    except ValueError as e:
        logger.info("decode runs op by op: %s", e)
        return None
    panels = sum(w.nbytes for layer in fused.layers
                 for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    logger.info("fused decode on the layers' panels: %.0f MiB", panels / 2**20)
    return fused
