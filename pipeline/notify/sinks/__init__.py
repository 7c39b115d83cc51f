"""One module per receiver: its payload (typed, within the receiver's documented limits) and
its HTTP call. ``build_sink`` turns a sink's configuration into one."""
