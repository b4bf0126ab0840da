"""Tile traces: where and when every output tile of a launch ran.

A kernel built with the trace flag (`kernels.compile.Variant(trace=True)`)
takes one more argument, an int64 buffer of `RECORD_WORDS` words per CTA
tile, and fills the record of each tile it computes:

    sm        %smid of the SM that ran it
    cta       linear CTA index (blockIdx.x + blockIdx.y * gridDim.x)
    tile_m, tile_n, group
              the CTA tile; `group` is the batch index (the K slice of a
              split-K launch)
    start_ns, end_ns
              %globaltimer when its mainloop began (sm90: when its
              consumers began it; sm100: when the leader CTA's MMA warp
              held its accumulator stage) and when its last store was
              issued. On sm100 one tile's epilogue runs beside the next
              one's mainloop, so an SM's tiles may overlap in time.
    claim_ns  dynamic schedulers: how long the claim that handed the tile
              out took, read by the scheduler warp (the atomic's round trip;
              for sm100's clc, a try_cancel from its issue to its decoded
              response); -1 for a tile no claim handed out (a cluster's
              first tile, a tile of another CTA than the cluster's leader,
              or any tile of a static schedule)

A record's slot is its tile's position ((group * tiles_m + tile_m) * tiles_n
+ tile_n), so no slot is shared and no atomic is needed: one thread of the
CTA's first consumer warpgroup (sm90; with pingpong consumers the warpgroup
whose turn it was) or of its epilogue warps (sm100) writes a tile's record,
the scheduler warp only the claim word, and on sm100 the leader CTA's MMA
warp only the start words (of both CTA tiles of a 2-CTA MMA). The host fills
the buffer with -1 first; a record whose end is still -1 is a tile nobody
ran. Without the flag none of this code is emitted (the PTX is the same as
before the flag existed: tested).
"""

from __future__ import annotations

# Host side only (no cutlass import): the device side is `kernels.trace_device`.
FIELDS = ("sm", "cta", "tile_m", "tile_n", "group", "start_ns", "end_ns", "claim_ns")
RECORD_WORDS = len(FIELDS)
