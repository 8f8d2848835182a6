"""Framework integrations: a ``Monitor`` driven from a framework's own training step.

- ``ampdoctor.integrations.transformers.AmpDoctorCallback``: the Hugging Face ``Trainer``;
- ``ampdoctor.integrations.lightning.AmpDoctorCallback``: Lightning;
- ``ampdoctor.integrations.accelerate.watch``: a hand-written ``accelerate`` loop, in one line;
- ``ampdoctor.integrations.deepspeed.watch``: a DeepSpeed ZeRO-1/2 engine, in one line.

Each module imports its framework (an optional extra: ``pip install ampdoctor[transformers]``,
``ampdoctor[lightning]``, ``ampdoctor[deepspeed]``); importing ``ampdoctor`` or this package imports none of them.
"""
