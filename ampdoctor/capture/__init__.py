"""The capture: a failing step of a real run, written by the Monitor and read back by ``triage --from``.

One module a job: ``trigger`` (when a step is a failure worth capturing), ``state`` (what a capture holds, read off
the live run with no collective), ``write`` (``Capture``: arming, holding the batches, writing the folder),
``schema`` (the format: the manifest's JSON Schema, the tensor files' checks), ``identity`` (which run and model a
capture belongs to), ``folder`` (one capture folder read), ``rank_folders`` (every rank's folder of one step),
``reassemble`` (a sharded step's pieces put back together on one process) and ``read`` (``read_capture``: where a
replay starts). The engines' pieces are ``ampdoctor.parallel``'s; the Monitor's calls in are
``engine.monitor.capturing``; the replay itself is the engine's.
"""
