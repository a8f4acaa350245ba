"""The oracle's records and compile settings, shared by its compiled passes.

A row's fields are one 16-byte record of ``OracleState.rows``, a resident slot's
one 64-byte record of ``OracleState.slots`` (a cache line each: a step touches
a few random rows of tables larger than the caches, so speed comes from memory).
Field indices, the ``_jit`` settings and the prefetch intrinsic live here; the
passes (:mod:`~torchrec_lookahead.oracle.kernels`), the victim order
(:mod:`~torchrec_lookahead.oracle.victims`) and the partition hash
(:mod:`~torchrec_lookahead.oracle.partitions`) compile against them. Numba freezes
these constants into the compiled code: see ``kernels.HELPERS_DIGEST``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "AHEAD",
    "BUCKETED",
    "FREE_GROUPS",
    "GROUP",
    "GROUPED",
    "GROUPS",
    "LAST_POS",
    "LAST_USE",
    "NEVER",
    "NEXT_USE",
    "PINNED",
    "PREV",
    "RESIDENT",
    "ROW",
    "ROW_FIELDS",
    "SLOT",
    "SLOT_FIELDS",
    "USES",
    "WHERE",
    "jit",
    "prefetch",
    "GOLDEN",
]

NEVER = 1 << 62  # next use of a row with no use in the window
# OracleState.rows columns: latest stream position (-1: none); slot if resident, else -1 - uses
LAST_POS, SLOT, ROW_FIELDS = 0, 1, 2
# OracleState.slots columns: the resident row's last and next use, its uses in planned
# steps (frozen while it waits as a candidate), where it waits, the previous slot in its
# group, its group, and the row itself; padded to a cache line (the next slot in a group
# or bucket is in the dense OracleState.link_next, which eviction walks)
LAST_USE, NEXT_USE, USES, WHERE, PREV, GROUP, ROW, SLOT_FIELDS = 0, 1, 2, 3, 4, 5, 6, 8
PINNED, GROUPED, BUCKETED = 0, 1, 2  # values of WHERE
RESIDENT = 0  # OracleState.counters: [slots used]
GROUPS, FREE_GROUPS = 0, 1  # GroupHeap.counters: [live groups, free group ids]
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: Fibonacci hashing's multiplier

jit = njit(nogil=True, cache=True)
AHEAD = 64  # loop iterations between a prefetch and the use of its row or slot


@intrinsic
def prefetch(typingctx, array, index):
    """Start loading ``array[index]`` (its first column) into the caches."""

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        at = [args[1]] + [ir.Constant(ir.IntType(64), 0)] * (aryty.ndim - 1)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, at, wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep, data
        return context.get_dummy_value()

    return types.void(array, index), codegen
