"""The parallel engines: one module per engine, each implementing ``parallel.protocol.Engine`` (read a rank's
pieces, reduce them in the step's exchange, record them in a capture, reassemble them on one process, rebuild the
layout on N), found by ``parallel.registry``."""
