"""The reports as plain data (triage and layers documents) and how they are built from records."""
