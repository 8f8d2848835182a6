"""Judging records: where a fault starts, what GradScaler did, and the rules that give the verdict."""
