"""The JSON report: Report.to_dict, versioned with schema_version."""

from __future__ import annotations

import json

from ampdoctor.report.model import Report


def render(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, sort_keys=False) + "\n"
