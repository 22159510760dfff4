"""The benchmark report: the paper's Table 1 with a noise floor, the Table 2 detail and
figures, for any target and method collections (``posteriorzoo report``)."""

from analysis.report.build import MixedDatasetsError, ReportResult, build_report

__all__ = ["MixedDatasetsError", "ReportResult", "build_report"]
