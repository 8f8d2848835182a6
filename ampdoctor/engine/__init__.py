"""Running steps: the one step recipe, the triage stages, the layers reference steps, the Monitor."""
