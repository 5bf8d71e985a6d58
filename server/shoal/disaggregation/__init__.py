"""Prefill/decode disaggregation: moving a request's KV cache from a prefill server to a decode
server over TCP (ZMQ), each prefill rank's KV heads and layers to the decode ranks that hold
them, whatever each side's tp and pp (docs/pd.md).

    messages.py   the KV channel's msgspec structs and their own decoder
    ranks.py      a transfer's state (KVPoll) and the ranks' agreement on it
    rooms.py      what both ends keep per room, and the transfer counters
    layout.py     what a prefill server announces and what a decode server checks (pure)
    kv_map.py     which prefill rank sends which decode rank which layers and KV heads (pure)
    transport.py  the I/O thread that owns one rank's sockets
    prefill.py    a prefill rank's end: rooms waiting for a destination, KV out
    decode.py     a decode rank's end: the prefill's layout, rooms receiving KV

The scheduler's prefill and decode roles (shoal.scheduler.prefill_role / decode_role) drive
these from the scheduler thread; nothing here knows about requests or batches.
"""
