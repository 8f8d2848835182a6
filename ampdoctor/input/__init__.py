"""Reading the user's input: the spec file, the batches, the options, the device."""
