"""LLVM IR building blocks of shoal's hand-written CPU kernels (numba intrinsics:
`shoal.kernels.panel_products`, `shoal.kernels.attention_tiles`): the vector width numba compiles
for on this host and the instructions those kernels share."""

from __future__ import annotations

from collections.abc import Callable

import numba
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils


def has_avx512() -> bool:
    """Whether numba compiles for AVX-512: the host's features, or NUMBA_CPU_FEATURES where
    set (as numba takes them)."""
    features = numba.config.CPU_FEATURES
    if features is None:
        return bool(llvm.get_host_cpu_features().get("avx512f"))
    return "+avx512f" in features.split(",")


# Floats of one vector register: 16 with AVX-512, else AVX2's 8.
VECTOR = 16 if has_avx512() else 8

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
VEC = ir.VectorType(F32, VECTOR)
_BYTE_PTR = ir.IntType(8).as_pointer()


def i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def zeros() -> ir.Constant:
    return ir.Constant(VEC, [0.0] * VECTOR)


def vector_at(builder: ir.IRBuilder, pointer: ir.Value, offset: ir.Value) -> ir.Value:
    """A float pointer `offset` floats past `pointer`, as a pointer to `VECTOR` floats."""
    return builder.bitcast(builder.gep(pointer, [offset]), VEC.as_pointer())


def broadcast(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """A float in every lane of a vector."""
    undef = ir.Constant(VEC, ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef, value, ir.Constant(I32, 0)),
                                  undef, ir.Constant(ir.VectorType(I32, VECTOR), [0] * VECTOR))


def fma(builder: ir.IRBuilder) -> ir.Function:
    """llvm.fma on vectors: fma(a, b, c) = a * b + c, one rounding."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(VEC, [VEC] * 3),
                                          f"llvm.fma.v{VECTOR}f32")


def prefetch(builder: ir.IRBuilder, pointer: ir.Value, locality: int) -> None:
    """llvm.prefetch (read, data) of the cache line at `pointer`: locality 3 keeps it in every
    cache level, 2 from the second on; a hint that never faults, whatever the address."""
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_BYTE_PTR, I32, I32, I32]),
        "llvm.prefetch.p0i8")
    builder.call(function, [builder.bitcast(pointer, _BYTE_PTR), ir.Constant(I32, 0),
                            ir.Constant(I32, locality), ir.Constant(I32, 1)])


def by_count(builder: ir.IRBuilder, count: ir.Value, most: int, name: str,
             emit: Callable[[int], None]) -> None:
    """Code specialized for each value 1..`most` of the runtime `count` (registers sized at
    compile time): a switch to one block per value, `emit(n)` writing block n's code; any
    other count runs block `most`. The builder continues after them."""
    done = builder.append_basic_block(f"{name}_done")
    blocks = [builder.append_basic_block(f"{name}_{n}") for n in range(1, most + 1)]
    switch = builder.switch(count, blocks[-1])
    for n, block in enumerate(blocks, start=1):
        switch.add_case(ir.Constant(count.type, n), block)
    for n, block in enumerate(blocks, start=1):
        builder.position_at_end(block)
        emit(n)
        builder.branch(done)
    builder.position_at_end(done)
