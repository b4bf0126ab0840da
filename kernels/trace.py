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
              %globaltimer when its consumers began the mainloop and when
              they had issued its last store
    claim_ns  dynamic schedulers: how long the claim that handed the tile
              out took (the atomic's round trip, read by the scheduler warp);
              -1 for a tile no claim handed out (a cluster's first tile, or
              any tile of a static schedule)

A record's slot is its tile's position ((group * tiles_m + tile_m) * tiles_n
+ tile_n), so no slot is shared and no atomic is needed: one thread of the
consumers that computed a tile (the CTA's first consumer warpgroup, or with
pingpong consumers the warpgroup whose turn it was) writes its record, the
scheduler warp only the claim word. The host fills the buffer with -1 first; a record whose
end is still -1 is a tile nobody ran. Without the flag none of this code is
emitted (the PTX is the same as before the flag existed: tested).
"""

from __future__ import annotations

# Host side only (no cutlass import): the device side is `kernels.trace_device`.
FIELDS = ("sm", "cta", "tile_m", "tile_n", "group", "start_ns", "end_ns", "claim_ns")
RECORD_WORDS = len(FIELDS)
