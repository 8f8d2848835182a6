"""Errors that the CLI turns into one line and exit code 2. The core never prints or exits."""

from __future__ import annotations


class AmpDoctorError(Exception):
    """Base class: the message says what to do next."""


class UsageError(AmpDoctorError):
    """Bad options or arguments."""


class SpecError(AmpDoctorError):
    """The user's spec file cannot be loaded or returns the wrong thing."""


class BatchError(AmpDoctorError):
    """A batch from the user's dataloader has a shape ampdoctor cannot use."""


class DeviceError(AmpDoctorError):
    """The requested device is not available."""


class OutputExistsError(AmpDoctorError):
    """An output file exists and --force was not given."""


class OutputError(AmpDoctorError):
    """An output cannot be written (a full disk, a quota, an I/O error); the message names the path and
    how many bytes were needed. Nothing half-written is left behind."""


class CaptureError(AmpDoctorError):
    """A capture folder (or checkpoint) cannot be read or does not fit the spec's model."""


class CheckpointError(CaptureError):
    """A training checkpoint cannot be read, or it does not fit the model the spec builds."""
