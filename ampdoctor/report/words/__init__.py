"""The English of ampdoctor, in one place: every sentence a user reads, by what it describes.

The rules (``ampdoctor.judge.rules``) return data: a cause with a ``facts["variant"]``, findings
with a code and evidence, fixes as ``Fix(code, facts)``. These modules turn them into the plain
sentences the Report carries (its JSON keeps the strings), formatting every number through
``ampdoctor.fmt``. They run when the Report is built, after a replay's steps were shifted to the
run's own numbers, so every step in every sentence is the run's.

Evidence keys that start with ``_`` are facts for these words only; ``diagnosis.write`` drops them.

- ``diagnosis``: the whole diagnosis (``write``): verdict, findings, fix sentences, GradScaler's story;
- ``verdicts``: the verdict's summary by variant, the deciding rule's finding title and fix;
- ``findings``: findings that stand on their evidence (warnings, the data scan), the scaler notes;
- ``evidence``: a finding's evidence as sentences, the places in the source an op is found at;
- ``fixes``: the fix sentences by ``Fix.code``;
- ``run``: what ran, a stage that stopped, a replay's hooks and scale;
- ``lookback``: the forecast, the spike, the story before a failure;
- ``common``: what these share (number formats, how an op or a layer is named);
- ``scaler``: GradScaler's story; ``stages``: the stages' hints and notes; ``monitor``: the Monitor's runtime
  messages; ``deepspeed``: the DeepSpeed integration's; ``layers``: the ``layers`` advice; ``check``: checkpoint
  health.
"""
